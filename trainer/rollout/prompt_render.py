"""Rendering a rollout's growing conversation to prompt ids, tokenizing only what is new.

The multi-turn loop renders the whole conversation with the chat template every turn (docs/multiturn.md).
Re-tokenizing that whole text every turn costs O(turns²) per rollout, on the worker's event loop.
:class:`ConversationRenderer` keeps the previous turn's text and ids and, when the new text starts
with the old text up to an *added token* (``<|im_end|>``, ``<tool_call>``...), tokenizes only the
text after it: a tokenizer extracts added tokens before normalising and pre-tokenizing, so the text
on either side of one tokenizes independently and the ids are exactly those of a full tokenization.
:func:`splits_at_added_tokens` checks that property for a tokenizer once (a tokenizer whose
pre-tokenizer treats the start of the input specially, like a SentencePiece ``Metaspace`` that
prepends a space to the first piece, fails it), and the renderer tokenizes in full when it fails.
A template that rewrites history (the new text does not start with the old one) is tokenized in full.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from trainer.rollout.chat_template import (
    build_assistant_message,
    reasoning_openings,
    render_prompt_text,
    rollout_family,
    synthetic_replies,
)

__all__ = ["ConversationRenderer", "splits_at_added_tokens"]


def _split_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """Added tokens matched on the raw text with nothing stripped around them: id -> text.

    The unknown token is left out: the model emits its id for text that is not its content.
    """
    return {
        i: t.content for i, t in tokenizer.added_tokens_decoder.items()
        if not (t.normalized or t.lstrip or t.rstrip or t.single_word) and i != tokenizer.unk_token_id
    }


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def splits_at_added_tokens(
    tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None, **kw: Any,
) -> bool:
    """Whether tokenizing a rendered conversation in pieces cut after added tokens gives its full ids.

    Checked on the synthetic tool conversations of
    :func:`~trainer.rollout.chat_template.check_prefix_preserving`, cut after every added token.

    Args:
        tokenizer: The tokenizer to check.
        tools: Tool schemas to render.
        chat_template: The template to render with (``None``: the tokenizer's).
        **kw: Extra chat-template variables.
    """
    split_ids = _split_token_ids(tokenizer)
    if not split_ids:
        return False
    family = rollout_family(chat_template or tokenizer.chat_template)
    for opening in reasoning_openings(family):
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Please do it in two calls."}]
        for text, results in synthetic_replies(tools, opening, family):
            calls = family.parse(text, tools)[1]
            messages += [build_assistant_message(text, family, tools),
                         *(family.tool_message(call, result) for call, result in zip(calls, results, strict=True))]
        rendered = render_prompt_text(tokenizer, messages, tools, chat_template, **kw)
        full = _encode(tokenizer, rendered)
        pieces: list[int] = []
        start = 0
        for i, token in enumerate(full):
            if token in split_ids:
                found = rendered.find(split_ids[token], start)
                if found < 0:
                    return False
                end = found + len(split_ids[token])
                if _encode(tokenizer, rendered[start:end]) != full[len(pieces): i + 1]:
                    return False
                pieces = full[: i + 1]
                start = end
        if pieces + _encode(tokenizer, rendered[start:]) != full:
            return False
    return True


class ConversationRenderer:
    """One rollout's prompt renderer: the ids of a full render, tokenizing only what changed.

    Args:
        tokenizer: The tokenizer with its chat template.
        tools: JSON schemas of the rollout's tools (``None`` for none).
        chat_template: A template to render with instead of the tokenizer's own.
        incremental: Reuse the previous turn's ids (only when :func:`splits_at_added_tokens` holds).
        **chat_template_kwargs: Extra template variables.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None, incremental: bool = True, **chat_template_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.chat_template = chat_template
        self.kwargs = chat_template_kwargs
        self._split_ids = _split_token_ids(tokenizer) if incremental else {}
        self._text = ""  # the last render, up to and including its last added token
        self._ids: list[int] = []  # the ids of ``_text``

    def __call__(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt ids of ``messages`` with the generation prompt (as :func:`render_prompt_ids`)."""
        text = render_prompt_text(self.tokenizer, messages, self.tools, self.chat_template, **self.kwargs)
        if self._text and text.startswith(self._text):
            ids = self._ids + _encode(self.tokenizer, text[len(self._text):])
        else:
            ids = _encode(self.tokenizer, text)
        self._remember(text, ids)
        return ids

    def _remember(self, text: str, ids: list[int]) -> None:
        """Keep ``text`` and ``ids`` up to the last added token (where the next tokenization may resume)."""
        for i in range(len(ids) - 1, -1, -1):
            token = self._split_ids.get(ids[i])
            if token is not None and (found := text.rfind(token)) >= 0:
                self._text = text[: found + len(token)]
                self._ids = ids[: i + 1]
                return
        self._text, self._ids = "", []
