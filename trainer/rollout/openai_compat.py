"""The OpenAI chat-completions wire format of the harness endpoint: requests in, responses out.

:func:`parse_chat_request` checks a ``POST /v1/chat/completions`` body and turns it into a
:class:`ChatRequest` (messages in the shape the chat template renders, tool schemas, the sampling
fields the endpoint honours); anything it cannot honour is an :class:`OpenAIRequestError`, which
:func:`error_body` turns into OpenAI's error object. :func:`reply_from_text` splits generated text
into reasoning, content and tool calls in the format of the model's family (:mod:`trainer.families`),
and :func:`completion_body` /
:func:`completion_chunks` write it as a ``chat.completion`` or as the ``chat.completion.chunk``
events of a streamed answer. Nothing here does I/O.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from trainer.exceptions import OpenAIRequestError
from trainer.families import QWEN3, Family

__all__ = [
    "ChatRequest",
    "OpenAIRequestError",
    "Reply",
    "assistant_key",
    "completion_body",
    "completion_chunks",
    "error_body",
    "parse_chat_request",
    "reply_from_text",
]


def error_body(error: OpenAIRequestError) -> dict[str, Any]:
    """OpenAI's error object for ``error`` (what the ``openai`` client raises ``APIStatusError`` from)."""
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        error.status, "invalid_request_error" if error.status < 500 else "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


@dataclass
class ChatRequest:
    """The parts of a chat-completions request that the endpoint uses.

    Attributes:
        messages: The conversation, normalised for the chat template (text content, ``developer``
            read as ``system``, tool-call arguments as given).
        tools: The request's tool schemas (``None`` without tools).
        parse_tools: Whether tool calls are read from the reply (``False`` for ``tool_choice="none"``).
        max_tokens: ``max_completion_tokens`` or ``max_tokens``, ``None`` when neither is given.
        stop: Stop strings.
        stream: Answer as server-sent events.
        include_usage: With ``stream``, end with a usage chunk (``stream_options.include_usage``).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or the concatenated ``text`` parts of a list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIRequestError(f"{where}: content part of type {kind!r} is not supported (text only)",
                                         param="messages")
            pieces.append(str(part.get("text", "")))
        return "".join(pieces)
    raise OpenAIRequestError(f"{where}: content must be a string or a list of text parts", param="messages")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise OpenAIRequestError(f"{where}: tool_calls must be a list", param="messages")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise OpenAIRequestError(f"{where}: each tool call needs function.name", param="messages")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str | dict):
            raise OpenAIRequestError(f"{where}: function.arguments must be a JSON string", param="messages")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _message(raw: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise OpenAIRequestError(f"{where} must be an object with a role", param="messages")
    role = "system" if raw["role"] == "developer" else raw["role"]
    if role not in ("system", "user", "assistant", "tool"):
        raise OpenAIRequestError(f"{where}: unsupported role {raw['role']!r}", param="messages")
    message: dict[str, Any] = {"role": role, "content": _text(raw.get("content"), where)}
    if role == "assistant" and raw.get("tool_calls"):
        message["tool_calls"] = _tool_calls(raw["tool_calls"], where)
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if raw.get(key) is not None:
                message[key] = str(raw[key])
    return message


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OpenAIRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
    return value


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a chat-completions body and keep what the endpoint honours.

    ``temperature``, ``top_p`` and ``model`` are accepted and not used: the trainer's sampling
    settings define the policy being trained. ``n`` must be 1.

    Raises:
        OpenAIRequestError: The body is not a chat-completions request the endpoint can answer.
    """
    if not isinstance(body, dict):
        raise OpenAIRequestError("the request body must be a JSON object")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise OpenAIRequestError("messages must be a non-empty list", param="messages")
    if body.get("n", 1) != 1:
        raise OpenAIRequestError("only n=1 is supported", param="n")
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise OpenAIRequestError("tools must be a list of {'type': 'function', 'function': {'name': str, ...}}",
                                 param="tools")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise OpenAIRequestError("stop must be a string or a list of non-empty strings", param="stop")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    options = body.get("stream_options") or {}
    return ChatRequest(
        messages=[_message(m, i) for i, m in enumerate(raw_messages)], tools=tools,
        parse_tools=tools is not None and body.get("tool_choice") != "none", max_tokens=max_tokens, stop=stop,
        stream=bool(body.get("stream")), include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
    )


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return str(arguments)
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def assistant_key(content: str | None, tool_calls: list[dict[str, Any]] | None) -> str:
    """What identifies an assistant message echoed back by an agent: its text and its calls.

    The endpoint keeps the generated text of each reply under this key, so a reply that comes back
    unchanged in a later request renders exactly as it was generated (ids aside, spacing aside).
    """
    calls = [(c["function"]["name"], _canonical_arguments(c["function"].get("arguments"))) for c in tool_calls or []]
    return json.dumps([(content or "").strip(), calls], ensure_ascii=False)


@dataclass
class Reply:
    """One answer: the message content, the tool calls as OpenAI writes them, and counts for metrics.

    Attributes:
        content: The text without its tool calls and reasoning (the whole text when a call was malformed).
        tool_calls: ``[{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}]``; the id
            is the family's own where its format writes one (Kimi K2's ``functions.NAME:0``).
        malformed_calls: Calls that could not be read (the text is returned whole inside ``content``).
        finish_reason: ``"tool_calls"``, ``"stop"`` or ``"length"``.
        reasoning_content: The reasoning the family's format sets apart (a ``<think>`` block, harmony's
            analysis channel), ``None`` without any.
        stray_markers: Fragments of call markup that are no call (``tools/malformed_frequency``).
    """

    content: str
    tool_calls: list[dict[str, Any]]
    malformed_calls: int
    finish_reason: str
    reasoning_content: str | None = None
    stray_markers: int = 0

    @property
    def key(self) -> str:
        """:func:`assistant_key` of this reply."""
        return assistant_key(self.content, self.tool_calls)


def reply_from_text(text: str, parse_tools: bool, truncated: bool, family: Family = QWEN3,
                    tools: list[dict[str, Any]] | None = None) -> Reply:
    """Split generated text into an OpenAI reply.

    Args:
        text: The decoded completion (stop strings already cut, no end-of-turn token).
        parse_tools: Read tool calls (the request had tools and ``tool_choice`` is not ``"none"``).
        truncated: The completion was cut by the length limit.
        family: The model's family, whose format the text is in.
        tools: The request's tool schemas (they type arguments a format writes as text).
    """
    reason = "length" if truncated else "stop"
    reasoning, rest = family.split_reasoning(text)
    if not parse_tools:
        return Reply(rest, [], 0, reason, reasoning)
    content, parsed = family.parse(text, tools)
    malformed = sum(1 for c in parsed if "error" in c)
    stray = family.malformed(text)
    if malformed:  # the agent sees exactly what the model wrote
        return Reply(text, [], malformed, reason, None, stray)
    if not parsed:
        return Reply(rest, [], 0, reason, reasoning, stray)
    calls = [{"id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
             for c in parsed if "error" not in c]
    return Reply(family.split_reasoning(content)[1], calls, 0, "length" if truncated else "tool_calls", reasoning,
                 stray)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(reply: Reply, model: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` answer."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
    if reply.reasoning_content is not None:
        message["reasoning_content"] = reply.reasoning_content
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": [{"index": 0, "message": message, "logprobs": None,
                                     "finish_reason": reply.finish_reason}],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def completion_chunks(reply: Reply, model: str, prompt_tokens: int, completion_tokens: int,
                      include_usage: bool) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` events of a streamed answer (the role, the reasoning, the content, each
    tool call, the finish reason, then the usage when asked for); the caller sends ``data: [DONE]`` after."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if reply.reasoning_content:
        chunks.append(chunk({"reasoning_content": reply.reasoning_content}))
    if reply.content:
        chunks.append(chunk({"content": reply.content}))
    for i, call in enumerate(reply.tool_calls):
        chunks.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                             "function": dict(call["function"])}]}))
    chunks.append(chunk({}, reply.finish_reason))
    if include_usage:
        chunks.append({**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
    return chunks
