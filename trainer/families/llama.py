"""The Llama 3.1-3.3 family: a call turn is bare JSON with ``"parameters"``; results come back as ``ipython``.

Llama 3.1's template writes a call turn as ``{"name": "increment", "parameters": {"step": 2}}`` and ends
it with ``<|eot_id|>``; several calls are separated by ``"; "`` (the form vLLM's ``llama3_json`` parser
reads; the stock template refuses more than one call per turn, the training template writes them
so). Text before the calls is read up to ``<|python_tag|>``; the templates write a call turn without
text. Tool results are turns of
the ``ipython`` role: ``<|start_header_id|>ipython<|end_header_id|>\\n\\n{result}<|eot_id|>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trainer.families.base import Family, Parsed, ToolCall, ToolCallFailure, failure, json_error, parse_arguments

__all__ = ["LLAMA3", "LlamaFamily"]

PYTHON_TAG = "<|python_tag|>"


def _read_object(obj: Any, raw: str) -> ToolCall | ToolCallFailure:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return failure('invalid tool call: expected {"name": <string>, "parameters": <object>}', raw)
    return parse_arguments(obj["name"], obj.get("parameters", obj.get("arguments", {})), raw)


@dataclass(frozen=True)
class LlamaFamily(Family):
    """Llama 3.x's JSON calls (``"parameters"``, or ``"arguments"`` as vLLM also reads)."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """See :meth:`Family.parse`: calls open the turn (its first non-blank character is ``{``) or
        follow ``<|python_tag|>``; each is one JSON object, separated by ``;``."""
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            content, rest = text[:tag], text[tag + len(PYTHON_TAG):]
        elif text.lstrip().startswith("{"):
            content, rest = "", text
        else:
            return text.strip(), []
        decoder = json.JSONDecoder()
        calls: list[ToolCall | ToolCallFailure] = []
        rest = rest.strip()
        while rest:
            try:
                obj, end = decoder.raw_decode(rest)
            except json.JSONDecodeError as exc:
                calls.append(failure(json_error(exc), rest))
                break
            calls.append(_read_object(obj, rest[:end]))
            rest = rest[end:].strip()
            if rest.startswith(";"):
                rest = rest[1:].strip()
            elif rest:
                calls.append(failure("invalid tool calls: separate calls with '; ' and write nothing after them",
                                     rest))
                break
        return content.strip(), calls

    def malformed(self, text: str) -> int:
        """Llama's calls have no closing marker that could stray: always 0."""
        return 0

    def format_calls(self, content: str, calls: list[ToolCall]) -> str:
        """The calls as ``{"name": ..., "parameters": {...}}`` joined by ``"; "``: Llama's templates write a
        call turn without its content (a turn with both is kept as the model wrote it)."""
        if not calls:
            return content
        return "; ".join(f'{{"name": {json.dumps(c["name"], ensure_ascii=False)}, '
                         f'"parameters": {json.dumps(c["arguments"], ensure_ascii=False)}}}' for c in calls)


LLAMA_SPECIAL = ("<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>", "<|eom_id|>", PYTHON_TAG)

LLAMA3 = LlamaFamily(
    name="llama3", title="Llama 3.1 / 3.2 / 3.3",
    markers=("<|start_header_id|>", "<|eot_id|>", "ipython", '"parameters"'),
    stop_tokens=("<|eot_id|>", "<|eom_id|>"), tool_role="ipython", reasoning=None, parallel_calls=False,
    training_template="llama3_training.jinja",
    special_tokens=LLAMA_SPECIAL, bos_token="<|begin_of_text|>", vllm_parser="llama3_json",
    checkpoints=("meta-llama/Llama-3.1-*-Instruct", "meta-llama/Llama-3.2-*-Instruct",
                 "meta-llama/Llama-3.3-70B-Instruct"),
)
"""Llama 3.1-3.3 (vLLM's ``llama3_json`` parser)."""
