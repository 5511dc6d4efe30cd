"""DeepSeek-V3 family: its tool-call format, the stock template detected and replaced, one sample per rollout.

``DEEPSEEK_V3_STYLE_STOCK`` is written here to behave like the DeepSeek-V3 family's stock template
(it is not its text): BOS then the system prompts, ``<｜User｜>``/``<｜Assistant｜>`` turns ending in
``<｜end▁of▁sentence｜>``, a turn's tool calls in one ``<｜tool▁calls▁begin｜>`` section of fenced JSON
calls, tool results in one ``<｜tool▁outputs▁begin｜>`` section whose end opens the next assistant turn
(no ``<｜Assistant｜>`` after tool results, in the generation prompt either), tool schemas left to the
system prompt. What makes it not prefix-preserving: every assistant turn is rendered from the text
after its last ``</think>``, so the reasoning a model emitted (and the empty ``<think>\\n\\n</think>``
block of a non-thinking turn) disappears from the earlier turns on the next render, and the tokens
the trainer holds no longer start the next prompt. It runs on the tiny model's tokenizer with the
family's markers added as tokens (no DeepSeek tokenizer can be downloaded here).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.trainer.rollout.test_training_templates import QWEN3_STYLE_STOCK
from toolgym.kit.warm_start import counter_tools
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.families import DEEPSEEK_V3, QWEN3, template_text
from trainer.records import TurnRecord
from trainer.rollout.chat_template import (
    build_assistant_message,
    check_prefix_preserving,
    parse_tool_calls,
    render_prompt_ids,
    rollout_family,
)
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.reconcile import reconcile_turns
from trainer.rollout.settings import RolloutSettings
from trainer.rollout.training_templates import renders_like_stock, rollout_chat_template
from trainer.vllm.server_info import ServerInfo

DEEPSEEK_V3_STYLE_STOCK = r"""
{%- set ns = namespace(system='', first=true, tool=false) -%}
{%- for m in messages if m.role == 'system' -%}
  {%- set ns.system = ns.system + ('' if ns.first else '\n\n') + m.content -%}{%- set ns.first = false -%}
{%- endfor -%}
{{- bos_token + ns.system -}}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}
    {%- if ns.tool -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- set ns.tool = false -%}{%- endif -%}
    {{- '<｜User｜>' + m.content -}}
  {%- elif m.role == 'assistant' -%}
    {%- if ns.tool -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- set ns.tool = false -%}
    {%- else -%}{{- '<｜Assistant｜>' -}}{%- endif -%}
    {%- set body = m.content if m.content is string else '' -%}
    {%- if '</think>' in body -%}{%- set body = body.split('</think>') | last -%}{%- endif -%}
    {{- body -}}
    {%- if m.tool_calls -%}
      {{- '<｜tool▁calls▁begin｜>' -}}
      {%- for c in m.tool_calls -%}
        {{- ('' if loop.first else '\n') + '<｜tool▁call▁begin｜>' + c.type + '<｜tool▁sep｜>' + c.function.name -}}
        {{- '\n```json\n' + (c.function.arguments | tojson) + '\n```<｜tool▁call▁end｜>' -}}
      {%- endfor -%}
      {{- '<｜tool▁calls▁end｜>' -}}
    {%- endif -%}
    {{- '<｜end▁of▁sentence｜>' -}}
  {%- elif m.role == 'tool' -%}
    {%- if ns.tool -%}{{- '\n<｜tool▁output▁begin｜>' -}}
    {%- else -%}{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' -}}{%- set ns.tool = true -%}{%- endif -%}
    {{- m.content + '<｜tool▁output▁end｜>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if ns.tool -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}
{%- if add_generation_prompt and not ns.tool -%}{{- '<｜Assistant｜>' -}}{%- endif -%}
"""

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
MARKERS = ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
           "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]


def _stock_tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"bos_token": BOS, "eos_token": EOS})
    tokenizer.add_tokens(MARKERS)  # not special: decoding with skip_special_tokens keeps them, as the loop needs
    tokenizer.chat_template = DEEPSEEK_V3_STYLE_STOCK
    return tokenizer


@pytest.fixture(scope="module")
def stock(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return _stock_tokenizer(tiny_model_dir)


def _call(step: int, name: str = "increment") -> str:
    return (f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{{\"step\": {step}}}\n```"
            "<｜tool▁call▁end｜>")


def _section(*calls: str) -> str:
    return "<｜tool▁calls▁begin｜>" + "\n".join(calls) + "<｜tool▁calls▁end｜>"


# Assistant texts as a DeepSeek-V3-family model emits them in a tool loop, the last one the final answer.
EPISODE = [
    "<think>\nStart with two.\n</think>\n\n" + _section(_call(2)),
    "<think>\n\n</think>\n\nAnd again." + _section(_call(1), _call(1)),
    "Next." + _section(_call(3)),
    "<think>\nDone.\n</think>\n\nThe counter is 7.",
]
TEMPLATE = template_text(str(DEEPSEEK_V3.training_template))
QWEN3_TRAINING = template_text(str(QWEN3.training_template))


def _play(tokenizer: PreTrainedTokenizerBase, template: str | None) -> list[list[int]]:
    """Each turn's prompt ids over :data:`EPISODE`, the conversation grown as the rollout loop grows it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Count."}, {"role": "user", "content": "To 7."}]
    prompts = []
    for i, text in enumerate(EPISODE):
        prompts.append(render_prompt_ids(tokenizer, messages, counter_tools(), template))
        messages.append(build_assistant_message(text, DEEPSEEK_V3))
        messages += [{"role": "tool", "content": str(i)} for _ in range(text.count("<｜tool▁call▁begin｜>"))]
    return prompts


def _extends(tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]) -> bool:
    for previous, text, prompt in zip(prompts[:-1], EPISODE[:-1], prompts[1:], strict=True):
        held = previous + tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if prompt[: len(held)] != held:
            return False
    return True


def test_the_format_follows_the_rendering_template(stock: PreTrainedTokenizerBase) -> None:
    assert rollout_family(DEEPSEEK_V3_STYLE_STOCK) is rollout_family(TEMPLATE) is DEEPSEEK_V3
    assert rollout_family(QWEN3_TRAINING) is rollout_family(None) is QWEN3


def test_deepseek_v3_style_stock_template_is_detected_and_replaced(stock: PreTrainedTokenizerBase,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    assert not check_prefix_preserving(stock, counter_tools())
    assert not _extends(stock, _play(stock, None)), "the stock template drops the reasoning of earlier turns"
    with caplog.at_level(logging.INFO, logger="trainer.rollout.training_templates"):
        template = rollout_chat_template(stock, counter_tools())
    assert template == TEMPLATE
    assert "DeepSeek-V3" in caplog.text and "deepseek_v3_training.jinja" in caplog.text
    assert stock.chat_template == DEEPSEEK_V3_STYLE_STOCK, "the tokenizer (and its checkpoints) keep the stock template"
    for tools in (counter_tools(), None):
        assert check_prefix_preserving(stock, tools, template)
    assert _extends(stock, _play(stock, template)), "every turn extends the tokens held so far"


def test_training_template_renders_the_prompt_and_final_turn_like_the_stock_one(
        stock: PreTrainedTokenizerBase) -> None:
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Count."}, {"role": "user", "content": "To 7."}]):
        assert render_prompt_ids(stock, messages, None, TEMPLATE) == render_prompt_ids(stock, messages)
    # After tool results the generation prompt is the end of their section, as in the stock template.
    prompts, stock_prompts = _play(stock, TEMPLATE), _play(stock, None)
    suffix = stock.encode("<｜tool▁output▁end｜><｜tool▁outputs▁end｜>", add_special_tokens=False)
    assert prompts[-1][-len(suffix):] == stock_prompts[-1][-len(suffix):] == suffix
    # The final answer rendered as the last message is the stock rendering (its reasoning cut).
    messages = [{"role": "user", "content": "To 7."}, build_assistant_message(EPISODE[-1], DEEPSEEK_V3)]
    ours = stock.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False)
    assert ours == stock.apply_chat_template(messages, tokenize=False) and "Done." not in ours


def test_each_family_gets_its_own_template(stock: PreTrainedTokenizerBase) -> None:
    assert not renders_like_stock(QWEN3, stock, counter_tools()), "the Qwen3 template does not fit DeepSeek's"
    other = AutoTokenizer.from_pretrained(stock.name_or_path)
    other.chat_template = QWEN3_STYLE_STOCK
    assert rollout_chat_template(other, counter_tools()) == QWEN3_TRAINING


def test_several_deepseek_calls_parse_in_order_and_rebuild_the_text() -> None:
    text = "Two calls." + _section(_call(2), _call(5, "reset"))
    content, calls = parse_tool_calls(text, DEEPSEEK_V3)
    assert content == "Two calls."
    assert calls == [{"name": "increment", "arguments": {"step": 2}}, {"name": "reset", "arguments": {"step": 5}}]
    message = build_assistant_message(text, DEEPSEEK_V3)
    assert message["content"] == "Two calls." and [c["function"]["name"] for c in message["tool_calls"]] == [
        "increment", "reset"]
    assert parse_tool_calls(text) == (text, []), "the Qwen path does not read DeepSeek calls"
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>', DEEPSEEK_V3)[1] == []


@pytest.mark.parametrize(("body", "error", "name"), [
    ('function<｜tool▁sep｜>increment\n```json\n{"step": 2,}\n```', "invalid tool call JSON: ", "increment"),
    ("function<｜tool▁sep｜>increment\n```json\n[2]\n```", "arguments must be a JSON object", "increment"),
    ('increment {"step": 2}', "expected function<｜tool▁sep｜><name>", None),
    ('function<｜tool▁sep｜>\n```json\n{"step": 2}\n```', "expected function<｜tool▁sep｜><name>", None),
])
def test_malformed_deepseek_calls_become_tool_errors(body: str, error: str, name: str | None) -> None:
    text = _section(_call(1), "<｜tool▁call▁begin｜>" + body + "<｜tool▁call▁end｜>")
    _, calls = parse_tool_calls(text, DEEPSEEK_V3)
    assert calls[0] == {"name": "increment", "arguments": {"step": 1}}
    assert error in calls[1]["error"] and calls[1]["name"] == name and calls[1]["arguments"] is None
    assert build_assistant_message(text, DEEPSEEK_V3) == {"role": "assistant", "content": text}, "kept verbatim"


def test_unterminated_deepseek_calls_are_failures() -> None:
    cut = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>increment\n```json\n{"st'
    cut_call = "<｜tool▁calls▁begin｜>" + _call(1) + "\n" + cut
    content, calls = parse_tool_calls("Go." + cut_call, DEEPSEEK_V3)
    assert content == "Go." and calls[0]["name"] == "increment" and calls[1]["error"] == "unterminated tool call"
    _, calls = parse_tool_calls("<｜tool▁calls▁begin｜>" + _call(1), DEEPSEEK_V3)
    assert len(calls) == 2 and calls[1]["error"] == "unterminated tool call section"


def increment(step: int) -> int:
    """Add to the counter.

    Args:
        step: How much to add.
    """
    return step


def _scripted_loop(tokenizer: PreTrainedTokenizerBase, tmp_path: Path, chat_template: str | None,
                   texts: list[str]) -> AsyncRolloutLoop:
    """The real rollout loop whose sampler is a script (``texts[i]`` answers the i-th turn, then EOS).

    A stand-in for the vLLM server: what is tested is the loop's rendering and parsing, and the tiny
    model knows nothing of DeepSeek's markers.
    """
    settings = RolloutSettings(model_name="tiny", vllm_server_base_url="http://127.0.0.1:9",
                               server=ServerInfo(model="tiny", max_model_len=4096), chat_template=chat_template,
                               max_completion_length=64)
    loop = AsyncRolloutLoop(settings, tokenizer, tools=[increment])
    script = iter(texts)

    async def turn(prompt_ids: list[int], params: Any = None) -> TurnRecord:
        ids = list(tokenizer(next(script), add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=[-0.5] * len(ids),
                          finish_reason="stop")

    loop.generate_one_turn = turn  # type: ignore[method-assign]
    return loop


@pytest.mark.parametrize("template", ["stock", "training"])
def test_a_deepseek_rollout_rendered_with_the_training_template_stays_one_sample(
        stock: PreTrainedTokenizerBase, tmp_path: Path, template: str) -> None:
    chosen = rollout_chat_template(stock, counter_tools()) if template == "training" else None
    loop = _scripted_loop(stock, tmp_path, chosen, EPISODE)
    prompt = [{"role": "system", "content": "Count."}, {"role": "user", "content": "To 7."}]

    async def go() -> Any:
        try:
            return await loop.generate_one(prompt, loop.tools)
        finally:
            await loop.sampler.close()

    rollout = asyncio.run(go())
    assert len(rollout.turns) == len(EPISODE) and rollout.tool_call_count == 4 and rollout.tool_failure_count == 0
    assert [m["content"] for m in rollout.completion if m["role"] == "tool"] == ["2", "1", "1", "3"]
    schemas = [t.schema for t in loop.tools]
    for i, turn in enumerate(rollout.turns):  # each turn's prompt is a full render of the conversation so far
        before = prompt + rollout.completion[: [j for j, m in enumerate(rollout.completion)
                                               if m["role"] == "assistant"][i]]
        assert turn.prompt_ids == render_prompt_ids(stock, before, schemas, chosen)
    sequences, stats = reconcile_turns(rollout.turns)
    if template == "training":
        assert stats.forks == 0 and stats.transitions == 3 and len(sequences) == 1
    else:
        # The two turns that opened with reasoning lose it on the next render: each forks a sequence.
        assert stats.transitions == 3 and stats.forks == 2 and len(sequences) == 3


def test_the_trainer_picks_the_deepseek_template_at_start(stock: PreTrainedTokenizerBase, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    config = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=1)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "To 7."}]]})
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), args=config, train_dataset=dataset,
                               processing_class=stock, tools=[increment])
    assert trainer.rollout_chat_template == TEMPLATE, "passed to the rollout loop"
    assert trainer.processing_class.chat_template == DEEPSEEK_V3_STYLE_STOCK
