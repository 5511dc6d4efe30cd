"""Chat-template helpers: prefix preservation, tool-call rendering and parsing, malformed calls."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from toolgym.kit.warm_start import counter_tools
from trainer.rollout.chat_template import (
    CHAT_TEMPLATE,
    build_assistant_message,
    check_prefix_preserving,
    parse_tool_calls,
    render_prompt_ids,
)

CALL = '<tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant_text(tokenizer: PreTrainedTokenizerBase, message: dict[str, Any]) -> str:
    """What the template renders for one assistant message, between the generation prompt and EOS."""
    conversation = [{"role": "user", "content": "go"}]
    before = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    after = tokenizer.apply_chat_template([*conversation, message], tokenize=False)
    assert after.startswith(before) and after.endswith("<|im_end|>\n")
    return after[len(before) : -len("<|im_end|>\n")]


@pytest.mark.parametrize("with_tools", [True, False])
def test_template_is_prefix_preserving(tokenizer: PreTrainedTokenizerBase, with_tools: bool) -> None:
    assert check_prefix_preserving(tokenizer, counter_tools() if with_tools else None)


def test_check_detects_a_template_that_rewrites_history(tokenizer: PreTrainedTokenizerBase) -> None:
    rewriting = copy.deepcopy(tokenizer)
    # Drop the tool calls of past assistant turns, as reasoning templates do with their thoughts.
    rewriting.chat_template = CHAT_TEMPLATE.replace(
        "message.tool_calls or []", "(message.tool_calls if loop.last else []) or []"
    )
    assert not check_prefix_preserving(rewriting, counter_tools())


def test_render_prompt_ids_ends_with_the_generation_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Increment the counter to 3."},
    ]
    ids = render_prompt_ids(tokenizer, messages, counter_tools())
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "increment"' in text and "Value to add to the counter." in text
    assert text.endswith("<|im_start|>user\nIncrement the counter to 3.<|im_end|>\n<|im_start|>assistant\n")
    assert ids == tokenizer.apply_chat_template(
        messages, tools=counter_tools(), add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_system_prompt_without_tools_and_tool_messages_grouped(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "", "tool_calls": [_call("f", {}), _call("g", {"x": 1})]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
    )


def test_a_misplaced_system_message_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "U"}, {"role": "system", "content": "S"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="unsupported message role system"):
        tokenizer.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": "", "tool_calls": [_call("increment", {"step": 2})]},
        {
            "role": "assistant",
            "content": "Two calls.",
            "tool_calls": [_call("a", {"q": "é ü"}), _call("b", {"n": [1, {"k": None}]})],
        },
        {"role": "assistant", "content": "The counter is now 4."},
    ],
)
def test_tool_calls_round_trip_through_render_parse_and_rebuild(
    tokenizer: PreTrainedTokenizerBase, message: dict[str, Any]
) -> None:
    text = _assistant_text(tokenizer, message)
    content, calls = parse_tool_calls(text)
    assert content == message["content"]
    assert calls == [c["function"] for c in message.get("tool_calls", [])]
    rebuilt = build_assistant_message(text)
    assert rebuilt == message
    assert _assistant_text(tokenizer, rebuilt) == text


def test_parse_keeps_emitted_order_and_strips_blocks_from_content() -> None:
    text = (
        'First <tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
        ' then <tool_call> {"name": "a"} </tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "First  then"
    assert calls == [{"name": "b", "arguments": {"x": 1}}, {"name": "a", "arguments": {}}]


def test_arguments_given_as_a_json_string_are_decoded() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert calls == [{"name": "f", "arguments": {"x": 2}}]


@pytest.mark.parametrize(
    ("block", "name", "error"),
    [
        ('<tool_call>\n{"name": "increment", "arguments": {"step": }\n</tool_call>', None, "JSON: Expecting value"),
        ("<tool_call>\n[1, 2]\n</tool_call>", None, "expected"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', None, "expected"),
        ('<tool_call>\n{"name": "increment", "arguments": [2]}\n</tool_call>', "increment", "must be a JSON object"),
        ('<tool_call>\n{"name": "increment", "arguments": {"step": 2', None, "unterminated tool call"),
    ],
)
def test_malformed_tool_calls_become_failure_records(
    tokenizer: PreTrainedTokenizerBase, block: str, name: str | None, error: str
) -> None:
    text = f"Trying.\n{CALL}\n{block}"
    content, calls = parse_tool_calls(text)
    assert content == "Trying."
    assert calls[0] == {"name": "increment", "arguments": {"step": 2}}
    failure = calls[1]
    assert "error" in failure and error in failure["error"]
    assert failure["name"] == name and failure["arguments"] is None
    assert failure["raw"] and failure["raw"] in block
    # The rebuilt message keeps the text verbatim, so the next prompt shows exactly what was generated.
    message = build_assistant_message(text)
    assert message == {"role": "assistant", "content": text}
    assert _assistant_text(tokenizer, message) == text


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name":"increment","arguments":{"step":2}}\n</tool_call>',  # other spacing
        '<tool_call>\n{"arguments": {"step": 2}, "name": "increment"}\n</tool_call>',  # other key order
        f"{CALL}\nDone.",  # text after the call
        f"Hi {CALL}",  # no newline before the call
        "  padded answer  ",
    ],
)
def test_non_canonical_text_is_kept_verbatim(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    message = build_assistant_message(text)
    assert message == {"role": "assistant", "content": text}
    assert _assistant_text(tokenizer, message) == text


def test_assistant_tokens_mask_covers_the_generated_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "user", "content": "Increment the counter to 2."},
        {"role": "assistant", "content": "", "tool_calls": [_call("increment", {"step": 2})]},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "The counter is now 2."},
    ]
    out = tokenizer.apply_chat_template(
        messages, tools=counter_tools(), return_assistant_tokens_mask=True, return_dict=True
    )
    trained = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(trained) == f"{CALL}<|im_end|>The counter is now 2.<|im_end|>"

