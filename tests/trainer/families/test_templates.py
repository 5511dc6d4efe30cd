"""Every family's template: prefix-preserving across tool-calling turns, each generated token trained once,
tool results rendered in the family's own layout, assistant tokens marked for the warm start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from tests.trainer.families.family_kit import COUNTER_TOOLS, episode, family_tokenizer, play
from trainer.families import Family, families, family_named, template_text
from trainer.rollout.chat_template import check_prefix_preserving, render_prompt_text
from trainer.rollout.reconcile import reconcile_turns

SHIPPED = [f for f in families() if f.training_template is not None][:8]
THINKING: dict[str, list[dict[str, Any]]] = {"qwen3": [{}, {"enable_thinking": False}],
                                            "qwen3_5": [{}, {"enable_thinking": False}],
                                            "glm4": [{}, {"enable_thinking": False}]}
CASES = [(f, kw) for f in SHIPPED for kw in THINKING.get(f.name, [{}])]
IDS = [f"{f.name}{'-nothink' if kw else ''}" for f, kw in CASES]
# How each family's template shows a tool result "7" to the model.
RESULT_LAYOUT = {
    "qwen3": "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>",
    "qwen3_5": "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>",
    "llama3": '<|start_header_id|>ipython<|end_header_id|>\n\n"7"<|eot_id|>',  # as JSON, as the stock one does
    "gpt_oss": '<|start|>functions.increment to=assistant<|channel|>commentary<|message|>"7"<|end|>',
    "mistral": "[TOOL_RESULTS]7[/TOOL_RESULTS]",
    "glm4": "<|observation|>\n<tool_response>\n7\n</tool_response>",
    "kimi_k2": "<|im_system|>tool<|im_middle|>## Return of functions.increment:0\n7<|im_end|>",
    "deepseek_v3": "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>7<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
}


class _Tokenizers(dict[str, PreTrainedTokenizerBase]):
    """Each family's tokenizer, with its training template, built on first use."""

    def __init__(self, tiny_model_dir: Path) -> None:
        super().__init__()
        self.tiny_model_dir = tiny_model_dir

    def __missing__(self, name: str) -> PreTrainedTokenizerBase:
        family = family_named(name)
        self[name] = family_tokenizer(self.tiny_model_dir, family, template_text(str(family.training_template)))
        return self[name]


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir: Path) -> dict[str, PreTrainedTokenizerBase]:
    return _Tokenizers(tiny_model_dir)


def test_every_family_ships_a_training_template() -> None:
    assert [f.name for f in SHIPPED] == ["qwen3", "qwen3_5", "llama3", "gpt_oss", "mistral", "glm4", "kimi_k2",
                                         "deepseek_v3"]


@pytest.mark.parametrize(("family", "kw"), CASES, ids=IDS)
def test_the_training_template_keeps_prefixes(family: Family, kw: dict[str, Any],
                                              tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    tokenizer = tokenizers[family.name]
    for tools in (COUNTER_TOOLS, None):
        assert check_prefix_preserving(tokenizer, tools, **kw)


@pytest.mark.parametrize(("family", "kw"), CASES, ids=IDS)
def test_each_generated_token_is_trained_once(family: Family, kw: dict[str, Any],
                                              tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    tokenizer = tokenizers[family.name]
    texts = episode(family)
    if kw.get("enable_thinking") is False and family.name == "qwen3_5":
        texts = [t.split("</think>\n\n", 1)[-1] for t in texts]  # the generation prompt closed the block
    turns, messages = play(tokenizer, family, texts, **kw)
    assert [m["role"] for m in messages].count("tool") == 3
    sequences, stats = reconcile_turns(turns)
    assert stats.forks == 0 and len(sequences) == 1, "every turn extends the held tokens"
    sequence = sequences[0]
    trained = [t for t, m in zip(sequence.input_ids, sequence.loss_mask, strict=True) if m]
    assert trained == [t for turn in turns for t in turn.output_ids], "each generated token trained once, in order"
    held = sequence.input_ids
    assert held[: len(turns[-1].prompt_ids)] == turns[-1].prompt_ids


@pytest.mark.parametrize("family", SHIPPED, ids=[f.name for f in SHIPPED])
def test_tool_results_render_in_the_familys_layout(family: Family,
                                                    tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    tokenizer = tokenizers[family.name]
    text = episode(family)[0]
    _, calls = family.parse(text, COUNTER_TOOLS)
    from trainer.rollout.chat_template import build_assistant_message

    messages = [{"role": "user", "content": "To 4."}, build_assistant_message(text, family, COUNTER_TOOLS),
                family.tool_message(calls[0], "7")]
    assert RESULT_LAYOUT[family.name] in render_prompt_text(tokenizer, messages, COUNTER_TOOLS)


@pytest.mark.parametrize("family", SHIPPED, ids=[f.name for f in SHIPPED])
def test_the_assistant_mask_covers_what_the_model_generates(family: Family,
                                                            tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    # The warm start trains on {% generation %} spans: they must be exactly the generated tokens.
    tokenizer = tokenizers[family.name]
    texts = episode(family)
    turns, messages = play(tokenizer, family, texts)
    out = tokenizer.apply_chat_template(messages, tools=COUNTER_TOOLS, return_assistant_tokens_mask=True,
                                        return_dict=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    marked = [t for t, m in zip(ids, mask, strict=True) if m]
    generated = [t for turn in turns[:-1] for t in turn.output_ids]
    assert marked[: len(generated)] == generated


def test_family_for_a_kit_tokenizer(tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    from trainer.families import family_for

    for family in SHIPPED:
        assert family_for(tokenizers[family.name]) is family
