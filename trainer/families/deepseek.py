"""The DeepSeek-V3 family: one section of calls per turn, each call's arguments in a fenced JSON block.

A turn's calls sit in one ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`` section, newline-separated,
each ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{arguments}\\n```<｜tool▁call▁end｜>``.
DeepSeek-V3.1 drops the type and the fence (``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}
<｜tool▁call▁end｜>``), which is read too. Tool results sit in a ``<｜tool▁outputs▁begin｜>`` section whose
end also opens the next assistant turn; turns end with ``<｜end▁of▁sentence｜>``.
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
    json_error,
    parse_arguments,
    split_blocks,
)

__all__ = ["DEEPSEEK_V3", "DeepSeekFamily"]

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# V3, inside a call: TYPE<｜tool▁sep｜>NAME, a newline, the arguments in a ```json fence.
_V3_BODY = re.compile(r"\s*\w+" + re.escape(SEP) + r"([^\n]*)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)
# V3.1: NAME<｜tool▁sep｜>{arguments}.
_V31_BODY = re.compile(r"\s*([^\s<]+)" + re.escape(SEP) + r"\s*(\{.*)", re.DOTALL)


def _read_call(raw: str) -> ToolCall | ToolCallFailure:
    """One call (between its begin and end markers), or why it is not one."""
    match = _V3_BODY.fullmatch(raw)
    if match is None and (v31 := _V31_BODY.fullmatch(raw)) is not None and v31.group(1) != "function":
        name, arguments = v31.group(1), v31.group(2)
    elif match is None or not match.group(1).strip():
        return failure(f"invalid tool call: expected function{SEP}<name>, a newline, then the arguments as a JSON "
                       "object in a ```json block", raw)
    else:
        name, arguments = match.group(1).strip(), match.group(2)
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return failure(json_error(exc), raw, name)
    return parse_arguments(name, value, raw)


@dataclass(frozen=True)
class DeepSeekFamily(Family):
    """DeepSeek-V3's (and V3.1's) call sections."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """See :meth:`Family.parse`; a call or a section never closed is a failure, and the section
        markers leave the content."""
        content, calls = split_blocks(text, CALL_BEGIN, CALL_END, _read_call)
        if text.count(CALLS_BEGIN) > text.count(CALLS_END) and not (calls and "error" in calls[-1]):
            raw = text[text.rfind(CALLS_BEGIN) + len(CALLS_BEGIN):].strip()
            calls.append(failure("unterminated tool call section", raw))
        return content.replace(CALLS_BEGIN, "").replace(CALLS_END, "").strip(), calls

    def malformed(self, text: str) -> int:
        """Call or section end markers without their opener."""
        return count_strays(text, CALL_BEGIN, CALL_END) + count_strays(text, CALLS_BEGIN, CALLS_END)

    def format_calls(self, content: str, calls: list[ToolCall]) -> str:
        """The content, then one section of fenced-JSON calls (V3's layout)."""
        if not calls:
            return content
        section = "\n".join(f"{CALL_BEGIN}function{SEP}{c['name']}\n```json\n"
                            f"{json.dumps(c['arguments'], ensure_ascii=False)}\n```{CALL_END}" for c in calls)
        return content + CALLS_BEGIN + section + CALLS_END


DEEPSEEK_SPECIAL = ("<｜▁pad▁｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
DEEPSEEK_TOKENS = ("<｜User｜>", "<｜Assistant｜>", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP,
                   "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                   "<｜tool▁output▁end｜>", "<think>", "</think>")

DEEPSEEK_V3 = DeepSeekFamily(
    name="deepseek_v3", title="DeepSeek-V3 / V3.1",
    markers=("<｜User｜>", "<｜Assistant｜>", CALLS_BEGIN, SEP, "<｜tool▁outputs▁begin｜>"),
    stop_tokens=("<｜end▁of▁sentence｜>",),
    training_template="deepseek_v3_training.jinja",
    tokens=DEEPSEEK_TOKENS, special_tokens=DEEPSEEK_SPECIAL, bos_token="<｜begin▁of▁sentence｜>",
    vllm_parser="deepseek_v3",
    checkpoints=("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3-0324", "deepseek-ai/DeepSeek-V3.1 (parse only)"),
)
"""DeepSeek-V3 and V3.1 (vLLM's ``deepseek_v3`` / ``deepseek_v31`` parsers)."""
