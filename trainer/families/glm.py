"""The GLM-4.5 / 4.6 / 4.7 family: ``<tool_call>NAME`` with ``<arg_key>``/``<arg_value>`` pairs.

GLM-4.5 and 4.6 write a call on lines of its own after the content (GLM-4.7 drops the newlines, which
is read the same way)::

    <tool_call>increment
    <arg_key>step</arg_key>
    <arg_value>2</arg_value>
    </tool_call>

A value is written as text when it is a string and as JSON otherwise, and read back typed by the
tool's schema. A turn has no end token of its own: the model stops by writing the next turn's role,
``<|observation|>`` (tool results follow, in ``<tool_response>`` blocks) or ``<|user|>``. Reasoning is a
``<think>`` block right after ``<|assistant|>``.
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
    schema_properties,
    split_blocks,
    typed_value,
)

__all__ = ["GLM4", "GLMFamily"]

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


def _read_call(raw: str, tools: list[dict[str, Any]] | None) -> ToolCall | ToolCallFailure:
    cut = raw.find("<arg_key>")
    name = (raw if cut < 0 else raw[:cut]).strip()
    if not name or "<" in name or "\n" in name:
        return failure("invalid tool call: expected <tool_call>NAME, then each argument as "
                       "<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>, then </tool_call>", raw.strip())
    body = "" if cut < 0 else raw[cut:]
    if _PAIR.sub("", body).strip():
        return failure(f"invalid tool call to {name!r}: expected <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> "
                       "pairs", raw.strip(), name)
    properties = schema_properties(tools, name) or {}
    arguments = {key.strip(): typed_value(value, properties.get(key.strip())) for key, value in _PAIR.findall(body)}
    return ToolCall(name=name, arguments=arguments)


@dataclass(frozen=True)
class GLMFamily(Family):
    """GLM-4.5's XML-ish calls."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """See :meth:`Family.parse`; argument values are typed by ``tools``' schemas (strings without one)."""
        content, calls = split_blocks(text, CALL_START, CALL_END, lambda raw: _read_call(raw, tools))
        return content.strip(), calls

    def malformed(self, text: str) -> int:
        """Closing ``</tool_call>`` markers without an opener."""
        return count_strays(text, CALL_START, CALL_END)

    def format_calls(self, content: str, calls: list[ToolCall]) -> str:
        """The content, then each call on lines of its own (GLM-4.5's layout)."""
        blocks = "".join(
            f"\n{CALL_START}{c['name']}\n" + "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                "</arg_value>\n" for k, v in c["arguments"].items()) + CALL_END for c in calls)
        return content + blocks

    def turn_end(self, has_calls: bool) -> str:
        """``<|observation|>`` (the tool results' turn) after a call, ``<|user|>`` after an answer."""
        return "<|observation|>" if has_calls else "<|user|>"


GLM_SPECIAL = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
GLM_TOKENS = (CALL_START, CALL_END, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
              "<tool_response>", "</tool_response>", "<think>", "</think>")

GLM4 = GLMFamily(
    name="glm4", title="GLM-4.5 / 4.6 / 4.7",
    markers=("<|assistant|>", "<|observation|>", "<arg_key>", "<arg_value>"),
    stop_tokens=("<|user|>", "<|observation|>", "<|endoftext|>"),
    training_template="glm4_training.jinja",
    tokens=GLM_TOKENS, special_tokens=GLM_SPECIAL, bos_token="[gMASK]", vllm_parser="glm45",
    checkpoints=("zai-org/GLM-4.5", "zai-org/GLM-4.5-Air", "zai-org/GLM-4.6", "zai-org/GLM-4.7"),
)
"""GLM-4.5 to 4.7 (vLLM's ``glm45`` / ``glm47`` parser)."""
