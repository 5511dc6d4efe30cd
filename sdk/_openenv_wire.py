"""OpenEnv's wire format as toolgym reads it: tool schemas, observations as text, error frames as our errors.

OpenEnv 0.10's WebSocket session (``/ws``) answers every frame with exactly one frame, in order, with
no request id: ``reset`` and ``step`` with ``{"type": "observation", "data": {"observation": {...},
"reward": ..., "done": ...}}``, ``state`` with ``{"type": "state", ...}``, ``mcp`` (a JSON-RPC
request in ``data``) with ``{"type": "mcp", "data": <JSON-RPC response>}``, and any failure with
``{"type": "error", "data": {"message": ..., "code": ...}}``. This module holds what both
``sdk.openenv`` and the env server's OpenEnv face need to agree on.
"""

from __future__ import annotations

import json
from typing import Any

from sdk.exceptions import (
    InvalidArgumentsError,
    ProtocolError,
    RemoteError,
    ServerFullError,
    SessionLostError,
    ToolCallError,
    ToolTimeoutError,
    UnknownToolError,
)

STEP_TOOL = "step"
"""The one tool of an action-style OpenEnv environment: its parameters are the action's JSON schema."""

OBSERVATION_ENVELOPE = frozenset(("done", "reward", "metadata"))
"""Fields every OpenEnv observation has; the rest are the environment's own."""


def openai_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style function schema, the shape toolgym's chat templates render."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def mcp_tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP ``tools/list`` entry (``inputSchema``, or OpenEnv's ``input_schema``) as a function schema."""
    parameters = tool.get("inputSchema", tool.get("input_schema")) or {"type": "object", "properties": {}}
    return openai_schema(str(tool["name"]), str(tool.get("description") or ""), parameters)


def action_tool_schema(action_schema: dict[str, Any]) -> dict[str, Any]:
    """The ``step`` tool of an action-style environment, from ``/schema``'s ``action``.

    The base ``Action``'s ``metadata`` field is the framework's, not the model's: it is dropped.
    """
    parameters = {k: v for k, v in action_schema.items() if k not in ("title", "description")}
    properties = {k: v for k, v in parameters.get("properties", {}).items() if k != "metadata"}
    parameters["properties"] = properties
    parameters.setdefault("type", "object")
    if "required" in parameters:
        parameters["required"] = [name for name in parameters["required"] if name in properties]
    description = action_schema.get("description") or f"Take one action ({action_schema.get('title', 'Action')})."
    return openai_schema(STEP_TOOL, str(description), parameters)


def observation_text(observation: dict[str, Any]) -> str:
    """The text the model reads for an observation: its one text field, else its own fields as JSON.

    The envelope (``done``, ``reward``, ``metadata``) and fields that are ``None`` or empty are left
    out; an observation with no field left reads as the empty string.
    """
    fields = {k: v for k, v in observation.items() if k not in OBSERVATION_ENVELOPE and v not in (None, "")}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return str(next(iter(fields.values())))
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":")) if fields else ""


def call_result_text(result: Any) -> tuple[str, bool]:
    """``(text, is_error)`` of an MCP ``tools/call`` result: its text content, else its data as JSON."""
    if not isinstance(result, dict):
        return ("" if result is None else str(result)), False
    is_error = bool(result.get("is_error", result.get("isError", False)))
    texts = [item.get("text", "") for item in result.get("content") or []
             if isinstance(item, dict) and item.get("type") == "text"]
    if texts:
        return "\n".join(str(t) for t in texts), is_error
    data = result.get("data", result.get("structured_content", result.get("structuredContent")))
    return (data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)), is_error


_TOOL_ERRORS: dict[str, type[ToolCallError]] = {
    "tool_not_found": UnknownToolError,
    "invalid_args": InvalidArgumentsError,
    "timeout": ToolTimeoutError,
}


def tool_error(error: dict[str, Any], tool: str) -> ToolCallError:
    """A ``CallToolObservation``'s ``error`` (``error_type``, ``message``) as the matching ``ToolCallError``."""
    error_type = str(error.get("error_type", "execution_error"))
    cls = _TOOL_ERRORS.get(error_type, ToolCallError)
    return cls(error_type, f"{tool}: {error.get('message', 'failed')}")


def error_frame(data: dict[str, Any], during: str, url: str) -> RemoteError | ProtocolError:
    """The error to raise for an OpenEnv ``error`` frame answering a ``during`` request (reset, step...).

    ``VALIDATION_ERROR`` and ``EXECUTION_ERROR`` of a step are the model's doing (tool failures); the
    same codes answering anything else, and every other code, are infrastructure errors.
    """
    code = str(data.get("code", "UNKNOWN"))
    message = f"OpenEnv server {url}: {data.get('message', 'error')} ({code})"
    if code == "VALIDATION_ERROR" and during == "step":
        details = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}"
                            for e in data.get("errors") or [] if isinstance(e, dict))
        return InvalidArgumentsError("invalid_arguments", f"{STEP_TOOL}: {details or data.get('message')}")
    if code == "EXECUTION_ERROR" and during == "step":
        return ToolCallError("tool_error", f"{STEP_TOOL}: {data.get('message', 'failed')}")
    if code == "CAPACITY_REACHED":
        return ServerFullError("server_full", message)
    if code == "SESSION_ERROR":
        return SessionLostError("session_not_found", message)
    if code in ("INVALID_JSON", "UNKNOWN_TYPE"):
        return ProtocolError(f"{message}: the server does not take toolgym's frames; is it OpenEnv 0.10?")
    return RemoteError("environment_error", message)
