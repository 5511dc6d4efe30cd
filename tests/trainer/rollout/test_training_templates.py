"""Training templates: a Qwen3-style stock template is detected, replaced, and the replacement keeps prefixes.

``QWEN3_STYLE_STOCK`` is written here to behave like the Qwen3 family's stock template (it is not
its text): the reasoning of assistant turns up to the last user query is dropped, a later turn keeps
it only when it has some or is the last message (re-spaced), and ``enable_thinking=False`` adds an
empty reasoning block to the generation prompt. It runs on the tiny model's tokenizer.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from toolgym.kit.warm_start import counter_tools
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.families import QWEN3, template_text
from trainer.rollout.chat_template import (
    build_assistant_message,
    check_prefix_preserving,
    render_prompt_ids,
)
from trainer.rollout.training_templates import rollout_chat_template

QWEN3_TRAINING = template_text(str(QWEN3.training_template))

QWEN3_STYLE_STOCK = r"""
{%- set ns = namespace(query=messages | length - 1, searching=true) -%}
{%- for m in messages | reverse -%}
  {%- if ns.searching and m.role == 'user' and not (m.content.startswith('<tool_response>')) -%}
    {%- set ns.searching = false -%}{%- set ns.query = messages | length - 1 - loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for t in tools -%}{{- '\n' + (t | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' -}}
  {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": ' -}}
  {{- '<args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set body = m.content -%}{%- set why = '' -%}
    {%- if m.reasoning_content is string -%}{%- set why = m.reasoning_content -%}
    {%- elif '</think>' in body -%}
      {%- set why = ((body.split('</think>') | first).split('<think>') | last).strip('\n') -%}
      {%- set body = (body.split('</think>') | last).lstrip('\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.query and (loop.last or why) -%}
      {{- '<|im_start|>assistant\n<think>\n' + why.strip('\n') + '\n</think>\n\n' + body.lstrip('\n') -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + body -}}
    {%- endif -%}
    {%- for c in m.tool_calls or [] -%}
      {%- set f = c.function if c.function is defined else c -%}
      {%- if body or not loop.first -%}{{- '\n' -}}{%- endif -%}
      {{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

THINKING = [{}, {"enable_thinking": False}, {"enable_thinking": True}]


@pytest.fixture(scope="module")
def stock(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = QWEN3_STYLE_STOCK
    return tokenizer


def _call(step: int) -> str:
    return f'<tool_call>\n{{"name": "increment", "arguments": {{"step": {step}}}}}\n</tool_call>'


# Assistant texts as a Qwen3 model emits them in a tool loop, the last one the final answer.
EPISODE = [
    "<think>\nStart with two.\n</think>\n\n" + _call(2),
    "<think>\n\n</think>\n\nAnd again.\n" + _call(1) + "\n" + _call(1),
    "Next.\n" + _call(3),
    "<think>\nDone.\n</think>\n\nThe counter is 7.",
]


def _play(tokenizer: PreTrainedTokenizerBase, template: str | None, kw: dict[str, Any]) -> list[list[int]]:
    """Each turn's prompt ids over :data:`EPISODE`, each prompt + its completion + EOS as the next's expected prefix."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Count."}, {"role": "user", "content": "To 7."}]
    prompts = []
    for i, text in enumerate(EPISODE):
        prompts.append(render_prompt_ids(tokenizer, messages, counter_tools(), template, **kw))
        messages.append(build_assistant_message(text))
        messages += [{"role": "tool", "content": str(i)} for _ in range(text.count("<tool_call>"))]
    return prompts


def _extends(tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]) -> bool:
    for previous, text, prompt in zip(prompts, EPISODE, prompts[1:], strict=False):
        held = previous + tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if prompt[: len(held)] != held:
            return False
    return True


@pytest.mark.parametrize("kw", THINKING)
def test_qwen3_style_stock_template_is_detected(stock: PreTrainedTokenizerBase, kw: dict[str, Any]) -> None:
    assert not check_prefix_preserving(stock, counter_tools(), **kw)
    assert not _extends(stock, _play(stock, None, kw)), "the stock template rewrites earlier turns"


@pytest.mark.parametrize("kw", THINKING)
def test_qwen3_style_stock_template_is_replaced(stock: PreTrainedTokenizerBase, kw: dict[str, Any],
                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="trainer.rollout.training_templates"):
        template = rollout_chat_template(stock, counter_tools(), **kw)
    assert template == QWEN3_TRAINING
    assert "Qwen3" in caplog.text and "training template" in caplog.text
    assert stock.chat_template == QWEN3_STYLE_STOCK, "the tokenizer (and its checkpoints) keep the stock template"
    assert check_prefix_preserving(stock, counter_tools(), template, **kw)
    assert _extends(stock, _play(stock, template, kw)), "every turn extends the tokens held so far"


@pytest.mark.parametrize("kw", THINKING)
def test_training_template_renders_the_final_turn_like_the_stock_one(
        stock: PreTrainedTokenizerBase, kw: dict[str, Any]) -> None:
    template = QWEN3_TRAINING
    # The first turn's prompt (generation prompt included), with and without tools and a system prompt.
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Count."}, {"role": "user", "content": "To 7."}]):
        for tools in (counter_tools(), None):
            assert (render_prompt_ids(stock, messages, tools, template, **kw)
                    == render_prompt_ids(stock, messages, tools, **kw))
    # The last turn's generation prompt: the tokens after the last tool result are the stock ones.
    prompts = _play(stock, template, kw)
    stock_prompts = _play(stock, None, kw)
    suffix = stock.encode("<|im_end|>\n<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n"
                          if kw.get("enable_thinking") is False else ""), add_special_tokens=False)
    assert prompts[-1][-len(suffix):] == stock_prompts[-1][-len(suffix):] == suffix
    # The final answer rendered as the last message is the stock rendering.
    messages = [{"role": "user", "content": "To 7."}, build_assistant_message(EPISODE[-1])]
    for message in (messages, [messages[0], {"role": "assistant", "content": "The counter is 7."}]):
        assert (stock.apply_chat_template(message, chat_template=template, tokenize=False, **kw)
                == stock.apply_chat_template(message, tokenize=False, **kw))


def test_prefix_preserving_template_is_kept(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert rollout_chat_template(tokenizer, counter_tools()) is None


def test_unknown_rewriting_template_warns_and_is_kept(stock: PreTrainedTokenizerBase,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    other = copy.deepcopy(stock)
    # Not the Qwen3 family: its generation prompt differs, so the training template would not fit.
    other.chat_template = QWEN3_STYLE_STOCK.replace("{{- '<|im_start|>assistant\\n' -}}\n",
                                                    "{{- '<|im_start|>assistant\\n\\n' -}}\n")
    assert other.chat_template != QWEN3_STYLE_STOCK
    with caplog.at_level(logging.WARNING, logger="trainer.rollout.training_templates"):
        assert rollout_chat_template(other, counter_tools()) is None
    assert "not prefix-preserving" in caplog.text and "rollout/fork_frac" in caplog.text


def increment(step: int) -> int:
    """Add to the counter.

    Args:
        step: How much to add.
    """
    return step


@pytest.mark.parametrize("kw", [{}, {"enable_thinking": False}])
def test_trainer_chooses_the_rollout_template_at_start(stock: PreTrainedTokenizerBase, tiny_model_dir: Path,
                                                       tmp_path: Path, kw: dict[str, Any],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    config = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=1,
                             chat_template_kwargs=kw)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "To 7."}]]})
    with caplog.at_level(logging.INFO, logger="trainer.rollout.training_templates"):
        trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), args=config, train_dataset=dataset,
                                   processing_class=stock, tools=[increment])
    assert trainer.rollout_chat_template == QWEN3_TRAINING, "passed to the rollout loop"
    assert "training template" in caplog.text
    assert trainer.processing_class.chat_template == QWEN3_STYLE_STOCK
