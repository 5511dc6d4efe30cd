"""What a model family is: :class:`Family`, the tool-call records it parses into, and the helpers its parsers share.

A family is the one home of what toolgym knows about a model family's chat format: how its assistant
turns write tool calls (:meth:`Family.parse`, :meth:`Family.format_calls`), how tool results go back
(:meth:`Family.tool_message`), where its reasoning goes (:meth:`Family.split_reasoning`), which tokens
end its turns, and which training template stands in for a stock template that is not
prefix-preserving. The shipped families live beside this module; :mod:`trainer.families.registry`
finds the one of a tokenizer.

Every parser here is toolgym's own rather than vLLM's (``vllm/tool_parsers/``), which the tests run on
the same texts: vLLM's parsers return a malformed call as content or drop it, where training must
report one failure per bad call to the model and count stray markers; they need vLLM installed (the
training image may not have it) and about 11 s to import; and GPT-OSS's needs harmony's token ids.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, NotRequired, TypedDict

__all__ = [
    "Family",
    "Parsed",
    "ToolCall",
    "ToolCallFailure",
    "count_strays",
    "failure",
    "find_blocks",
    "json_error",
    "parse_arguments",
    "schema_properties",
    "split_blocks",
    "template_text",
    "typed_value",
]


class ToolCall(TypedDict):
    """A well-formed tool call, as emitted: the tool's name and its keyword arguments.

    Attributes:
        name: The tool's name.
        arguments: The keyword arguments (typed by the tool's schema where the format writes them as text).
        id: The family's own id of the call where its format writes one (Kimi K2's
            ``functions.NAME:0``); the tool message that answers it carries it back.
    """

    name: str
    arguments: dict[str, Any]
    id: NotRequired[str]


class ToolCallFailure(TypedDict):
    """A tool call that could not be read; report ``error`` to the model as the tool message and count
    a tool failure, instead of calling anything.

    Attributes:
        name: The tool name when it could be read, else ``None``.
        arguments: Always ``None``, so that ``tool(**call["arguments"])`` on a failure fails loudly.
        error: A one-line explanation meant for the model, e.g. ``"invalid tool call JSON: Expecting
            ',' delimiter (line 1, column 30)"``.
        raw: The text of the call (the rest of the text for an unterminated one).
    """

    name: str | None
    arguments: None
    error: str
    raw: str


@cache
def template_text(filename: str) -> str:
    """The text of a template shipped in ``trainer/families/templates``."""
    return resources.files("trainer.families").joinpath("templates", filename).read_text(encoding="utf-8")


Parsed = tuple[str, list[ToolCall | ToolCallFailure]]
"""``(content, calls)``: what :meth:`Family.parse` returns."""


def failure(error: str, raw: str, name: str | None = None) -> ToolCallFailure:
    """A :class:`ToolCallFailure` (shorthand for the parsers)."""
    return ToolCallFailure(name=name, arguments=None, error=error, raw=raw)


def json_error(exc: json.JSONDecodeError) -> str:
    """The model-facing message of a JSON error in a call."""
    return f"invalid tool call JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"


def parse_arguments(name: str, arguments: Any, raw: str) -> ToolCall | ToolCallFailure:
    """A call to ``name`` when ``arguments`` is an object or a JSON text holding one, else a failure.

    Args:
        name: The tool's name, as read.
        arguments: A dict, or a string (the JSON text of the format, or OpenAI's JSON-string form).
        raw: The call's text, for the failure.
    """
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return failure(json_error(exc), raw, name)
    if not isinstance(arguments, dict):
        return failure(f"invalid tool call to {name!r}: arguments must be a JSON object", raw, name)
    return ToolCall(name=name, arguments=arguments)


def schema_properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any] | None:
    """The ``properties`` of tool ``name``'s parameter schema (OpenAI tool form), ``None`` when unknown."""
    for tool in tools or []:
        function = tool.get("function", tool)
        if isinstance(function, dict) and function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else None
    return None


def _schema_types(schema: Any) -> set[str]:
    """Every JSON type a property schema admits (``type``, ``enum`` values, ``anyOf``/``oneOf``/``allOf``)."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else {t for t in declared or [] if isinstance(t, str)}
    for value in schema.get("enum") or []:
        types.add({bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
                   list: "array", dict: "object"}.get(type(value), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) or []:
            types |= _schema_types(choice)
    return types


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def typed_value(text: str, schema: Any) -> Any:
    """An argument the format wrote as text, typed by its property schema.

    The types are tried in the order null, integer, number, boolean, object, array, string (as vLLM's
    parsers do, so both read a call alike); the first that reads the text wins. A text no declared type
    reads, or a property without a schema, stays a string: the tool's own validation then answers the
    model.
    """
    types = _schema_types(schema)
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind not in types:
            continue
        if kind == "string":
            return text
        if kind == "null" and text.strip().lower() == "null":
            return None
        if kind == "integer" and re.fullmatch(r"\s*[-+]?\d+\s*", text):
            return int(text)
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        if kind == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        if kind in ("object", "array"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict if kind == "object" else list) and _finite(value):
                return value
    return text


def find_blocks(text: str, start: str, end: str) -> tuple[str, list[tuple[str, bool]]]:
    """Every ``start ... end`` block of ``text``, in order: its inside and whether it was closed.

    A ``start`` never closed takes the rest of the text; a stray ``end`` stays outside.

    Returns:
        The text outside the blocks and the blocks.
    """
    blocks: list[tuple[str, bool]] = []
    pieces: list[str] = []
    pos = 0
    while (opened := text.find(start, pos)) >= 0:
        pieces.append(text[pos:opened])
        closed = text.find(end, opened + len(start))
        if closed < 0:
            blocks.append((text[opened + len(start):], False))
            return "".join(pieces), blocks
        blocks.append((text[opened + len(start):closed], True))
        pos = closed + len(end)
    pieces.append(text[pos:])
    return "".join(pieces), blocks


def split_blocks(text: str, start: str, end: str,
                 read: Callable[[str], ToolCall | ToolCallFailure]) -> tuple[str, list[ToolCall | ToolCallFailure]]:
    """Cut every ``start ... end`` block out of ``text`` and ``read`` its inside, in order.

    A ``start`` never closed is an unterminated call (a failure holding the rest of the text, which
    leaves the content); a stray ``end`` stays in the content (:func:`count_strays` counts it).

    Returns:
        The text outside the blocks and the records.
    """
    outside, blocks = find_blocks(text, start, end)
    return outside, [read(inner) if closed else failure("unterminated tool call", inner.strip())
                     for inner, closed in blocks]


def count_strays(text: str, start: str, end: str) -> int:
    """How many ``end`` markers in ``text`` close no ``start`` (a fragment of a call, not a call)."""
    depth = strays = 0
    for match in re.finditer(f"{re.escape(start)}|{re.escape(end)}", text):
        if match.group() == start:
            depth = 1
        elif depth:
            depth = 0
        else:
            strays += 1
    return strays


@dataclass(frozen=True)
class Family(ABC):
    """A model family's chat format, as the trainer needs it. Subclass it for a format of your own and
    register an instance with :func:`trainer.families.register_family`.

    Attributes:
        name: The registry name (``"qwen3_5"``), what ``family_named`` and ``--family`` take.
        title: The checkpoints it covers, for messages (``"Qwen3.5 / Qwen3.6 / Qwen3-Coder"``).
        markers: Text every stock chat template of the family contains: how :func:`family_for`
            recognises it (the family with the most markers present wins).
        stop_tokens: The tokens that end an assistant turn, the one after a final answer first
            (:meth:`turn_end` picks among them).
        tool_role: The role the family's templates render tool results under (``"ipython"`` for Llama 3);
            the messages themselves keep the ``tool`` role.
        reasoning: The markers around a reasoning block, ``None`` for a family without one.
        parallel_calls: Whether the family's stock templates render several calls in one assistant turn
            (Llama 3.1's refuses them, GPT-OSS's renders the first only): the agreement probes of
            :mod:`trainer.rollout.training_templates` use one call where they do not.
        training_template: The file under ``trainer/families/templates`` that renders like the stock
            template but keeps earlier turns as generated; ``None`` when the stock one keeps prefixes.
        kit_template: The file the tiny-model kit stores in a tokenizer of this family (``None``: the
            training template).
        tokens: Markers that the family's tokenizers hold as single tokens and that are not special.
        special_tokens: The family's special tokens (roles, ends of turns...). The tiny-model kit adds
            both kinds, and pads with the first special token.
        bos_token: The begin-of-sequence token its templates write first, if any.
        vllm_parser: vLLM's ``--tool-call-parser`` name for the same format (the tests compare).
        checkpoints: The checkpoints whose stock templates the family was written against (docs).
    """

    name: str
    title: str
    markers: tuple[str, ...]
    stop_tokens: tuple[str, ...]
    tool_role: str = "tool"
    reasoning: tuple[str, str] | None = ("<think>", "</think>")
    parallel_calls: bool = True
    training_template: str | None = None
    kit_template: str | None = None
    tokens: tuple[str, ...] = ()
    special_tokens: tuple[str, ...] = ()
    bos_token: str | None = None
    vllm_parser: str | None = None
    checkpoints: tuple[str, ...] = ()

    @abstractmethod
    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """Split an assistant turn's text into its content and its tool calls, in emitted order.

        Never raises: a call that cannot be read is a :class:`ToolCallFailure` (test with
        ``"error" in call``), one per bad call, an unterminated one included.

        Args:
            text: The decoded completion, without its end-of-turn token.
            tools: The tools offered (OpenAI form); their schemas type the arguments a format writes as text.

        Returns:
            ``(content, calls)``: the text without its calls (stripped), and the calls.
        """

    @abstractmethod
    def malformed(self, text: str) -> int:
        """How many fragments of call markup in ``text`` are not calls (a closing marker without its
        opener): counted in ``tools/malformed_frequency``, neither run nor penalised."""

    @abstractmethod
    def format_calls(self, content: str, calls: list[ToolCall]) -> str:
        """The text the family's template renders inside an assistant turn for ``content`` and ``calls``:
        what a model of the family emits, and what :func:`parse` reads back into them."""

    def training_template_texts(self) -> tuple[str, ...]:
        """The training templates to try against a stock template, in order (one per variant of the stock
        template the family ships; none without a training template)."""
        return (template_text(self.training_template),) if self.training_template else ()

    def kit_template_text(self) -> str | None:
        """The chat template the tiny-model kit stores in a tokenizer of this family: the kit template, else
        the training template (``None`` when the family ships neither)."""
        filename = self.kit_template or self.training_template
        return template_text(filename) if filename else None

    def turn_end(self, has_calls: bool) -> str:
        """The token that ends an assistant turn (with or without calls)."""
        return self.stop_tokens[0]

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, rest)`` of an assistant turn's text: the reasoning block's inside (``None``
        without one) and the text after it. A closing marker without its opener closes a block that
        the generation prompt opened."""
        if self.reasoning is None:
            return None, text
        start, end = self.reasoning
        cut = text.find(end)
        if cut < 0:
            return None, text
        before = text[:cut]
        opened = before.find(start)
        if opened >= 0 and before[:opened].strip():
            return None, text
        reasoning = before[opened + len(start):] if opened >= 0 else before
        return reasoning.strip("\n"), text[cut + len(end):].lstrip("\n")

    def tool_message(self, call: Mapping[str, Any], content: str) -> dict[str, Any]:
        """The message that gives the model a call's result, as the family's templates take it."""
        message: dict[str, Any] = {"role": "tool", "name": call.get("name") or "", "content": content}
        if call.get("id"):
            message["tool_call_id"] = call["id"]
        return message
