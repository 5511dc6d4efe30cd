"""Incremental prompt rendering: every turn's ids equal a full render's, while only new text is tokenized."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

import trainer.rollout.prompt_render as prompt_render
from toolgym.kit.warm_start import counter_tools
from trainer.rollout.chat_template import (
    CHAT_TEMPLATE,
    build_assistant_message,
    render_prompt_ids,
)
from trainer.rollout.prompt_render import ConversationRenderer, splits_at_added_tokens

CALL = '<tool_call>\n{"name": "increment", "arguments": {"step": %d}}\n</tool_call>'
# Assistant texts and tool results chosen to stress token boundaries: reasoning blocks, leading and
# trailing whitespace, non-ASCII text, a malformed call kept verbatim, an empty tool result.
TURNS: list[tuple[str, list[str]]] = [
    ("<think>\nTwo, then more.\n</think>\n\n" + CALL % 2, ["2"]),
    ("\n\n  Café → ünïcode  \n" + CALL % 1 + "\n" + CALL % 3, ["3", "\n\n6  \n"]),
    ("<tool_call>\n{not json}\n</tool_call>", ["Error: invalid tool call JSON"]),
    ("<think>\n\n</think>\n\nDone:" + CALL % 0, [""]),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _conversations() -> list[list[dict[str, Any]]]:
    """The conversation before each turn (system + user first)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Count."}, {"role": "user", "content": "To 6."}]
    stages = [list(messages)]
    for text, results in TURNS:
        messages += [build_assistant_message(text), *({"role": "tool", "content": r} for r in results)]
        stages.append(list(messages))
    return stages


def _spy_encoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every text the renderer tokenizes."""
    seen: list[str] = []
    encode = prompt_render._encode

    def spy(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
        seen.append(text)
        return encode(tokenizer, text)

    monkeypatch.setattr(prompt_render, "_encode", spy)
    return seen


@pytest.mark.parametrize("with_tools", [True, False])
def test_incremental_ids_equal_full_render(tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch,
                                           with_tools: bool) -> None:
    tools = counter_tools() if with_tools else None
    assert splits_at_added_tokens(tokenizer, tools)
    render = ConversationRenderer(tokenizer, tools)
    seen = _spy_encoded(monkeypatch)
    full_chars = 0
    for messages in _conversations():
        ids = render(messages)
        assert ids == render_prompt_ids(tokenizer, messages, tools)
        full_chars += len(tokenizer.decode(ids))
    assert sum(map(len, seen)) < full_chars / 2, "later turns tokenize only the text they added"


def test_history_rewriting_template_falls_back_to_full_tokenization(tokenizer: PreTrainedTokenizerBase) -> None:
    # Past assistant turns lose their tool calls: the new text does not start with the old one.
    rewriting = CHAT_TEMPLATE.replace("message.tool_calls or []", "(message.tool_calls if loop.last else []) or []")
    render = ConversationRenderer(tokenizer, counter_tools(), chat_template=rewriting)
    for messages in _conversations():
        assert render(messages) == render_prompt_ids(tokenizer, messages, counter_tools(), rewriting)


def test_tokenizer_that_marks_the_start_of_input_is_tokenized_in_full() -> None:
    # A SentencePiece-style pre-tokenizer that prepends "▁" to the start of the input only: a suffix
    # tokenized alone would get one more piece, so the check refuses incremental tokenization.
    text = CHAT_TEMPLATE + json.dumps(counter_tools()) + "".join(t + "".join(r) for t, r in TURNS) + "Count.To6.▁"
    vocab = {"<unk>": 0, **{ch: i + 1 for i, ch in enumerate(sorted(set(text)))}}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))  # one token per character
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    metaspace = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"])
    metaspace.chat_template = CHAT_TEMPLATE
    assert not splits_at_added_tokens(metaspace, counter_tools())
    render = ConversationRenderer(metaspace, counter_tools(), incremental=False)
    for messages in _conversations():
        assert render(messages) == render_prompt_ids(metaspace, messages, counter_tools())
