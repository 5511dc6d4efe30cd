"""The Qwen families: Qwen3 / Hermes (JSON inside ``<tool_call>``) and Qwen3.5 / Qwen3.6 / Qwen3-Coder (XML).

Both write ChatML turns (``<|im_start|>role\\n...<|im_end|>``), reasoning in ``<think>`` blocks and
tool results as ``<tool_response>`` blocks in a ``user`` turn. Qwen3 writes a call as::

    <tool_call>
    {"name": "increment", "arguments": {"step": 2}}
    </tool_call>

and Qwen3.5 as (argument values as text, typed by the tool's schema when read)::

    <tool_call>
    <function=increment>
    <parameter=step>
    2
    </parameter>
    </function>
    </tool_call>
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
    json_error,
    parse_arguments,
    schema_properties,
    split_blocks,
    template_text,
    typed_value,
)

__all__ = ["QWEN3", "QWEN3_5", "HermesFamily", "QwenXMLFamily"]

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_TOKENS = (CALL_START, CALL_END, "<tool_response>", "</tool_response>")


def _read_json_call(raw: str) -> ToolCall | ToolCallFailure:
    """One Hermes block's JSON: ``{"name": <string>, "arguments": <object>}`` (missing arguments: ``{}``)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return failure(json_error(exc), raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return failure('invalid tool call: expected {"name": <string>, "arguments": <object>}', raw)
    return parse_arguments(obj["name"], obj.get("arguments", {}), raw)


@dataclass(frozen=True)
class HermesFamily(Family):
    """Hermes-style calls: a JSON object with ``name`` and ``arguments`` in each ``<tool_call>`` block
    (Qwen2.5, Qwen3, Hermes); calls on their own lines after the content."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """See :meth:`Family.parse`; a JSON string holding the arguments object is accepted too."""
        content, calls = split_blocks(text, CALL_START, CALL_END, lambda raw: _read_json_call(raw.strip()))
        return content.strip(), calls

    def malformed(self, text: str) -> int:
        """Closing ``</tool_call>`` markers without an opener."""
        return count_strays(text, CALL_START, CALL_END)

    def format_calls(self, content: str, calls: list[ToolCall]) -> str:
        """The content, then each call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""
        blocks = [f'{CALL_START}\n{{"name": {json.dumps(c["name"], ensure_ascii=False)}, '
                  f'"arguments": {json.dumps(c["arguments"], ensure_ascii=False)}}}\n{CALL_END}' for c in calls]
        return "\n".join([content, *blocks] if content else blocks)


_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def _xml_value(value: Any) -> str:
    """How the template writes an argument value: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _trim_newlines(value: str) -> str:
    """The value without the one newline the template writes on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _read_xml_call(raw: str, tools: list[dict[str, Any]] | None) -> ToolCall | ToolCallFailure:
    """One ``<function=NAME>`` with its ``<parameter=KEY>`` values, or why it is not one."""
    match = _FUNCTION.fullmatch(raw)
    if match is None or not match.group(1).strip():
        return failure("invalid tool call: expected <function=NAME>, then each argument as "
                       "<parameter=KEY>VALUE</parameter>, then </function>", raw.strip())
    name, body = match.group(1).strip(), match.group(2)
    properties = schema_properties(tools, name) or {}
    arguments: dict[str, Any] = {}
    for parameter in _PARAMETER.finditer(body):
        key = parameter.group(1).strip()
        arguments[key] = typed_value(_trim_newlines(parameter.group(2)), properties.get(key))
    if _PARAMETER.sub("", body).strip():
        return failure(f"invalid tool call to {name!r}: text outside <parameter=KEY>...</parameter>", raw.strip(),
                       name)
    return ToolCall(name=name, arguments=arguments)


# How the training template reads the thinking switch; Qwen3.5's small checkpoints think only when asked to.
_THINKING_BY_DEFAULT = "{%- set no_thinking = enable_thinking is defined and enable_thinking is false -%}"
_THINKING_WHEN_ASKED = "{%- set no_thinking = not (enable_thinking is defined and enable_thinking is true) -%}"


@dataclass(frozen=True)
class QwenXMLFamily(Family):
    """Qwen3.5's XML calls: ``<tool_call>`` around ``<function=NAME>`` and one ``<parameter=KEY>`` per argument."""

    def training_template_texts(self) -> tuple[str, ...]:
        """The training template for checkpoints that think by default (Qwen3.5-4B and larger, Qwen3.6), then
        its variant for those that think only with ``enable_thinking=True`` (Qwen3.5-2B and smaller)."""
        text = template_text(str(self.training_template))
        return text, text.replace(_THINKING_BY_DEFAULT, _THINKING_WHEN_ASKED)

    def kit_template_text(self) -> str | None:
        """The variant that thinks only when asked, as Qwen3.5's small checkpoints do: the tiny model answers
        after the generation prompt's closed reasoning block."""
        return self.training_template_texts()[-1]

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """See :meth:`Family.parse`; argument values are typed by ``tools``' schemas (strings without one)."""
        content, calls = split_blocks(text, CALL_START, CALL_END, lambda raw: _read_xml_call(raw, tools))
        return content.strip(), calls

    def malformed(self, text: str) -> int:
        """Closing ``</tool_call>`` markers without an opener, and ``<function=`` outside a ``<tool_call>``."""
        outside, _ = find_blocks(text, CALL_START, CALL_END)
        return count_strays(text, CALL_START, CALL_END) + outside.count("<function=")

    def format_calls(self, content: str, calls: list[ToolCall]) -> str:
        """The content, a blank line, then the calls one per line (Qwen3.5's layout)."""
        blocks = []
        for call in calls:
            parameters = "".join(f"<parameter={key}>\n{_xml_value(value)}\n</parameter>\n"
                                 for key, value in call["arguments"].items())
            blocks.append(f"{CALL_START}\n<function={call['name']}>\n{parameters}</function>\n{CALL_END}")
        calls_text = "\n".join(blocks)
        return f"{content}\n\n{calls_text}" if content and calls_text else content + calls_text


QWEN3 = HermesFamily(
    name="qwen3", title="Qwen3 / Qwen2.5 / Hermes",
    markers=("<|im_start|>", CALL_START, '"arguments"'),
    stop_tokens=("<|im_end|>",),
    training_template="qwen3_training.jinja", kit_template="qwen3_kit.jinja",
    tokens=QWEN_TOKENS, special_tokens=CHATML_TOKENS, vllm_parser="hermes",
    checkpoints=("Qwen/Qwen3-*", "Qwen/Qwen3-*-Thinking-2507", "Qwen/Qwen3-*-Instruct-2507", "Qwen/Qwen2.5-*-Instruct",
                 "NousResearch/Hermes-3-*"),
)
"""Qwen3 and the Hermes format (vLLM's ``hermes`` parser)."""

QWEN3_5 = QwenXMLFamily(
    name="qwen3_5", title="Qwen3.5 / Qwen3.6 / Qwen3-Coder",
    markers=("<|im_start|>", CALL_START, "<function=", "<parameter="),
    stop_tokens=("<|im_end|>",),
    training_template="qwen3_5_training.jinja",
    tokens=(*QWEN_TOKENS, "<think>", "</think>"), special_tokens=CHATML_TOKENS, vllm_parser="qwen3_xml",
    checkpoints=("Qwen/Qwen3.5-*", "Qwen/Qwen3.6-*", "Qwen/Qwen3-Coder-*"),
)
"""Qwen3.5, Qwen3.6 and Qwen3-Coder's XML format (vLLM's ``qwen3_xml`` / ``qwen3_coder`` parsers)."""
