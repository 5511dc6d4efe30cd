"""The Kimi K2 family: a section of calls, each with Kimi's id ``functions.NAME:INDEX`` and JSON arguments.

::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.increment:0<|tool_call_argument_begin|>{"step": 2}
    <|tool_call_end|><|tool_calls_section_end|>

(without the line break). The index counts the calls of the conversation. A result comes back in a
``tool`` turn naming the call's id: ``<|im_system|>tool<|im_middle|>## Return of functions.increment:0
\\n4<|im_end|>``, so the tool message carries it (``tool_call_id``). Turns end with ``<|im_end|>``;
Kimi K2 Thinking reasons in a ``<think>`` block.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from trainer.families.base import (
    Family,
    Parsed,
    ToolCall,
    ToolCallFailure,
    count_strays,
    failure,
    find_blocks,
    parse_arguments,
    split_blocks,
)

__all__ = ["KIMI_K2", "KimiFamily"]

SECTION_START, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_START, CALL_END, ARGUMENTS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
_ID = re.compile(r"\s*((?:[\w.-]+\.)?([\w-]+):\d+)\s*")


def _read_call(raw: str) -> ToolCall | ToolCallFailure:
    header, sep, arguments = raw.partition(ARGUMENTS)
    match = _ID.fullmatch(header)
    if not sep or match is None:
        return failure(f"invalid tool call: expected functions.NAME:INDEX{ARGUMENTS}{{arguments as a JSON object}}",
                       raw.strip())
    call = parse_arguments(match.group(2), arguments.strip(), raw.strip())
    if "error" not in call:
        call["id"] = match.group(1)  # type: ignore[typeddict-unknown-key]  # a ToolCall: "error" is absent
    return call


@dataclass(frozen=True)
class KimiFamily(Family):
    """Kimi K2's call sections."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """See :meth:`Family.parse`; each call keeps Kimi's id (``id``). A section never closed is a failure."""
        content, sections = find_blocks(text, SECTION_START, SECTION_END)
        calls: list[ToolCall | ToolCallFailure] = []
        for section, closed in sections:
            outside, found = split_blocks(section, CALL_START, CALL_END, _read_call)
            calls += found
            if not closed:  # cut short: what it held is read, and an unfinished call is already a failure
                if not found or "error" not in found[-1]:
                    calls.append(failure("unterminated tool call section", section.strip()))
            elif outside.strip():
                calls.append(failure("invalid tool call section: text outside <|tool_call_begin|>...<|tool_call_end|>",
                                     outside.strip()))
        return content.strip(), calls

    def malformed(self, text: str) -> int:
        """Call or section end markers without their opener."""
        return count_strays(text, SECTION_START, SECTION_END) + count_strays(text, CALL_START, CALL_END)

    def format_calls(self, content: str, calls: list[ToolCall]) -> str:
        """The content, then one section with each call under its id (``functions.NAME:i`` without one)."""
        if not calls:
            return content
        ids = [c.get("id") or f"functions.{c['name']}:{i}" for i, c in enumerate(calls)]
        section = "".join(f"{CALL_START}{i}{ARGUMENTS}{json.dumps(c['arguments'], ensure_ascii=False)}{CALL_END}"
                          for i, c in zip(ids, calls, strict=True))
        return f"{content}{SECTION_START}{section}{SECTION_END}"


KIMI_SPECIAL = ("[PAD]", "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                "<|im_middle|>", SECTION_START, SECTION_END, CALL_START, ARGUMENTS, CALL_END)

KIMI_K2 = KimiFamily(
    name="kimi_k2", title="Kimi K2",
    markers=("<|im_assistant|>", "<|im_middle|>", SECTION_START, CALL_START),
    stop_tokens=("<|im_end|>",),
    training_template="kimi_k2_training.jinja",
    tokens=("<think>", "</think>"), special_tokens=KIMI_SPECIAL, bos_token="[BOS]", vllm_parser="kimi_k2",
    checkpoints=("moonshotai/Kimi-K2-Instruct", "moonshotai/Kimi-K2-Instruct-0905", "moonshotai/Kimi-K2-Thinking"),
)
"""Kimi K2 (vLLM's ``kimi_k2`` parser)."""
