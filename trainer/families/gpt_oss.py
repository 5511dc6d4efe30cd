"""The GPT-OSS family: OpenAI's harmony format, messages on channels, calls addressed ``to=functions.NAME``.

After the generation prompt ``<|start|>assistant`` a model writes one or more messages, each a header
(``<|channel|>analysis``, ``final`` or ``commentary``, a recipient ``to=functions.NAME`` for a call,
``<|constrain|>json`` for JSON arguments) then ``<|message|>`` and its body; messages end with
``<|end|>`` and the next opens with ``<|start|>assistant``. A call ends the turn with ``<|call|>``, a
final answer with ``<|return|>``::

    <|channel|>analysis<|message|>Two steps.<|end|><|start|>assistant<|channel|>commentary
    to=functions.increment <|constrain|>json<|message|>{"step": 2}<|call|>

Reasoning is the ``analysis`` channel. A call's result comes back as a message from the tool:
``<|start|>functions.increment to=assistant<|channel|>commentary<|message|>4<|end|>``. vLLM's ``openai``
tool parser for this format reads harmony token ids (it needs the ``openai_harmony`` encoding), so it
cannot run on decoded text: this parser reads the text the rollout loop decodes, markers included.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from trainer.families.base import Family, Parsed, ToolCall, ToolCallFailure, failure, parse_arguments

__all__ = ["GPT_OSS", "HarmonyFamily"]

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")
_BODY_END = re.compile("|".join(re.escape(m) for m in (END, CALL, RETURN)))


@dataclass(frozen=True)
class _Message:
    channel: str | None
    recipient: str | None
    body: str | None  # None: no <|message|> (cut short)
    raw: str
    ended_with_call: bool


def _messages(text: str) -> list[_Message]:
    """The harmony messages of a completion, in order (the first continues the generation prompt)."""
    out = []
    for piece in text.split(START):
        if not piece.strip():
            continue
        header, sep, body = piece.partition(MESSAGE)
        end = _BODY_END.search(body) if sep else None
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        out.append(_Message(
            channel=channel.group(1) if channel else None, recipient=recipient.group(1) if recipient else None,
            body=(body[: end.start()] if end else body) if sep else None, raw=piece,
            ended_with_call=end.group() == CALL if end else CALL in piece))
    return out


def _read_call(message: _Message) -> ToolCall | ToolCallFailure:
    assert message.recipient is not None
    name = message.recipient.removeprefix("functions.")
    if message.body is None:
        return failure("unterminated tool call", message.raw.strip(), name)
    if not name:
        return failure("invalid tool call: expected to=functions.NAME", message.raw.strip())
    return parse_arguments(name, message.body.strip(), message.raw.strip())


@dataclass(frozen=True)
class HarmonyFamily(Family):
    """OpenAI's harmony format (GPT-OSS)."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """See :meth:`Family.parse`: each message addressed ``to=functions.NAME`` is a call (its body the
        JSON arguments); the content is the ``final`` and ``commentary`` messages' text, the reasoning
        (``analysis``) left out. Text without any harmony marker is content."""
        if not any(marker in text for marker in (START, MESSAGE, CHANNEL)):
            return text.strip(), []
        content: list[str] = []
        calls: list[ToolCall | ToolCallFailure] = []
        for message in _messages(text):
            if message.recipient is not None:
                calls.append(_read_call(message))
            elif message.channel != "analysis" and message.body is not None:
                content.append(message.body)
        return "\n".join(c.strip() for c in content if c.strip()), calls

    def malformed(self, text: str) -> int:
        """Messages ended by ``<|call|>`` that are addressed to no tool."""
        return sum(m.ended_with_call and m.recipient is None for m in _messages(text))

    def format_calls(self, content: str, calls: list[ToolCall]) -> str:
        """As the family's templates write a turn after ``<|start|>assistant``: a ``final`` message for
        content without calls; else the content as an ``analysis`` message, then one message per call
        (`` to=functions.NAME<|channel|>commentary json<|message|>{...}``, ``<|call|>`` between calls: the
        last one's ends the turn). A model may put the recipient after the channel instead, which
        :meth:`parse` reads too (the turn is then kept as written)."""
        if not calls:
            return f"{CHANNEL}final{MESSAGE}{content}"
        messages = [f"{CHANNEL}analysis{MESSAGE}{content}{END}"] if content else []
        messages += [f" to=functions.{c['name']}{CHANNEL}commentary json{MESSAGE}"
                     f"{json.dumps(c['arguments'], ensure_ascii=False)}" for c in calls]
        return (START + "assistant").join(
            m if m.endswith(END) or i == len(messages) - 1 else m + CALL for i, m in enumerate(messages))

    def turn_end(self, has_calls: bool) -> str:
        """``<|call|>`` after a call, ``<|return|>`` after a final answer."""
        return CALL if has_calls else RETURN

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        """The ``analysis`` channel's text, and the text of the other messages."""
        if not any(marker in text for marker in (START, MESSAGE, CHANNEL)):
            return None, text
        messages = _messages(text)
        analysis = [m.body.strip() for m in messages if m.channel == "analysis" and m.body is not None]
        rest = [m.body.strip() for m in messages if m.channel != "analysis" and m.recipient is None
                and m.body is not None]
        return ("\n".join(analysis) if analysis else None), "\n".join(r for r in rest if r)


HARMONY_TOKENS = ("<|endoftext|>", "<|startoftext|>", START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)

GPT_OSS = HarmonyFamily(
    name="gpt_oss", title="GPT-OSS (harmony)",
    markers=(START, CHANNEL, MESSAGE, CALL, " to=assistant"),
    stop_tokens=(RETURN, CALL), reasoning=None, parallel_calls=False,
    training_template="gpt_oss_training.jinja",
    special_tokens=HARMONY_TOKENS, vllm_parser=None,
    checkpoints=("openai/gpt-oss-20b", "openai/gpt-oss-120b"),
)
"""GPT-OSS in OpenAI's harmony format (vLLM's ``openai`` parser works on harmony token ids, not text)."""
