"""The Mistral family: calls after ``[TOOL_CALLS]``, in the current ``name[ARGS]{...}`` form or the older JSON list.

Tokenizers from v11 on (Mistral Small 3.2, Magistral, Devstral) write each call as
``[TOOL_CALLS]increment[ARGS]{"step": 2}``, one marker per call, and the turn ends with ``</s>``;
earlier ones (Mistral 7B v0.3, Mistral Small 3.1) write ``[TOOL_CALLS][{"name": "increment",
"arguments": {"step": 2}, "id": "a1b2c3d4e"}]``. Both are read; calls are written in the current form.
Results come back as ``[TOOL_RESULTS]4[/TOOL_RESULTS]``; reasoning (Magistral) is a ``[THINK]...[/THINK]``
block. The older stock templates (Mistral 7B v0.3's) refuse a tool result without the 9-character
alphanumeric id of its call: a call's own id is kept, and a call written without one gets one
derived from its name and arguments, so every tool message carries an id such a template takes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.families.base import Family, Parsed, ToolCall, ToolCallFailure, failure, json_error, parse_arguments

__all__ = ["MISTRAL", "MistralFamily", "call_id"]

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


def _read_list(segment: str) -> tuple[list[ToolCall | ToolCallFailure], str]:
    """The older form: a JSON list of ``{"name", "arguments"}`` (or one object); returns what follows it."""
    try:
        obj, end = json.JSONDecoder().raw_decode(segment)
    except json.JSONDecodeError as exc:
        return [failure(json_error(exc), segment)], ""
    calls: list[ToolCall | ToolCallFailure] = []
    for item in obj if isinstance(obj, list) else [obj]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            calls.append(failure('invalid tool call: expected {"name": <string>, "arguments": <object>}',
                                 json.dumps(item, ensure_ascii=False)))
        else:
            call = parse_arguments(item["name"], item.get("arguments", {}), json.dumps(item, ensure_ascii=False))
            if "error" not in call and isinstance(item.get("id"), str) and item["id"]:
                call["id"] = item["id"]  # type: ignore[typeddict-unknown-key]  # a ToolCall: "error" is absent
            calls.append(call)
    return calls, segment[end:]


def call_id(call: Mapping[str, Any]) -> str:
    """A 9-character alphanumeric id for a call written without one, the same for the same name and arguments."""
    key = json.dumps([call.get("name"), call.get("arguments")], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(key.encode()).hexdigest()[:9]


def _read_named(segment: str) -> tuple[ToolCall | ToolCallFailure, str]:
    """The current form: ``NAME[ARGS]{...}`` (or ``NAME{...}``); returns what follows the arguments."""
    cut = segment.find(ARGS)
    brace = segment.find("{")
    if cut < 0 and brace < 0:
        return failure(f"invalid tool call: expected NAME{ARGS}{{arguments as a JSON object}}", segment), ""
    if cut < 0 or 0 <= brace < cut:
        name, rest = segment[:brace], segment[brace:]
    else:
        name, rest = segment[:cut], segment[cut + len(ARGS):]
    name = name.strip()
    if not name:
        return failure(f"invalid tool call: expected NAME{ARGS}{{arguments as a JSON object}}", segment), ""
    try:
        arguments, end = json.JSONDecoder().raw_decode(rest.lstrip())
    except json.JSONDecodeError as exc:
        return failure(json_error(exc), segment, name), ""
    return parse_arguments(name, arguments, segment), rest.lstrip()[end:]


@dataclass(frozen=True)
class MistralFamily(Family):
    """Mistral's ``[TOOL_CALLS]`` calls, both forms."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """See :meth:`Family.parse`: the content is the text before the first ``[TOOL_CALLS]`` (and any
        text after a call's JSON); each ``[TOOL_CALLS]`` opens a call (or, before a ``[``, a list of them).
        A call of the older form keeps its ``id``."""
        content, *segments = text.split(TOOL_CALLS)
        pieces = [content]
        calls: list[ToolCall | ToolCallFailure] = []
        for segment in segments:
            segment = segment.strip()
            if not segment:
                continue
            if segment[0] in "[{":
                found, after = _read_list(segment)
                calls += found
            else:
                call, after = _read_named(segment)
                calls.append(call)
            pieces.append(after)
        return "".join(pieces).strip(), calls

    def malformed(self, text: str) -> int:
        """``[ARGS]`` markers outside a call (not after its ``[TOOL_CALLS]``)."""
        return self.parse(text)[0].count(ARGS)

    def tool_message(self, call: Mapping[str, Any], content: str) -> dict[str, Any]:
        """See :meth:`Family.tool_message`; ``tool_call_id`` is the call's id, or :func:`call_id`'s."""
        return super().tool_message({**call, "id": call.get("id") or call_id(call)}, content)

    def format_calls(self, content: str, calls: list[ToolCall]) -> str:
        """The content, then ``[TOOL_CALLS]NAME[ARGS]{...}`` per call."""
        return content + "".join(f"{TOOL_CALLS}{c['name']}{ARGS}{json.dumps(c['arguments'], ensure_ascii=False)}"
                                 for c in calls)


MISTRAL_TOKENS = ("<pad>", "<s>", "</s>", "[INST]", "[/INST]", TOOL_CALLS, ARGS, "[TOOL_RESULTS]",
                  "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                  "[THINK]", "[/THINK]")

MISTRAL = MistralFamily(
    name="mistral", title="Mistral / Magistral / Devstral",
    markers=("[INST]", TOOL_CALLS, "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
    stop_tokens=("</s>",), reasoning=("[THINK]", "[/THINK]"),
    training_template="mistral_training.jinja",
    special_tokens=MISTRAL_TOKENS, bos_token="<s>", vllm_parser="mistral",
    checkpoints=("mistralai/Mistral-Small-3.2-24B-Instruct-2506", "mistralai/Magistral-Small-2506",
                 "mistralai/Devstral-Small-2507", "mistralai/Mistral-7B-Instruct-v0.3 (parse only)"),
)
"""Mistral's ``[TOOL_CALLS]`` formats (vLLM's ``mistral`` parser)."""
