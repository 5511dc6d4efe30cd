"""The wire protocol shared by the env server and the remote client (``docs/protocol.md``).

One WebSocket per session at ``/v1/ws/{env}?v=1`` (add ``&session=ID`` to resume). The server
speaks first with a ``hello`` frame; afterwards every client frame is a request with an integer
``id`` and an ``op``, and the server answers each with exactly one reply echoing that ``id``::

    -> {"id": 1, "op": "reset", "kwargs": {"target": 3}}
    <- {"id": 1, "ok": true, "result": "Increment the counter to 3."}
    -> {"id": 2, "op": "call", "tool": "increment", "args": {"step": "x"}}
    <- {"id": 2, "ok": false, "error": {"code": "invalid_arguments", "message": "..."}}

Frames are JSON text. This module holds the constants and the small helpers both sides use, so the
two ends cannot drift apart.
"""

from __future__ import annotations

import enum
import json
import json.decoder
import json.encoder
from typing import Any

from sdk.exceptions import (
    AuthenticationError,
    InvalidArgumentsError,
    RemoteError,
    ServerDrainingError,
    ServerFullError,
    SessionLostError,
    ToolCallError,
    ToolTimeoutError,
    UnknownEnvironmentError,
    UnknownToolError,
)

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change; the client sends it as ``?v=``, the server echoes it in ``hello``."""

WS_PATH = "/v1/ws/{env}"
ENVS_PATH = "/v1/envs"

# Application close codes (4000-4999 are free for applications in RFC 6455).
CLOSE_SESSION_ENDED = 4000
"""The server ended the session (after ``close``, eviction, drain or takeover); see the ``bye`` frame."""


class Op(enum.StrEnum):
    """Frame operations. Client requests: reset, call, reward, ping, close. Server pushes: hello, bye."""

    HELLO = "hello"
    RESET = "reset"
    CALL = "call"
    REWARD = "reward"
    PING = "ping"
    CLOSE = "close"
    BYE = "bye"


class ErrorCode(enum.StrEnum):
    """Typed error codes carried in ``{"error": {"code": ..., "message": ...}}``."""

    BAD_FRAME = "bad_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    UNKNOWN_OP = "unknown_op"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNAUTHORIZED = "unauthorized"
    UNKNOWN_ENVIRONMENT = "unknown_environment"
    UNKNOWN_TOOL = "unknown_tool"
    INVALID_ARGUMENTS = "invalid_arguments"
    TOOL_ERROR = "tool_error"
    CALL_TIMEOUT = "call_timeout"
    ENVIRONMENT_ERROR = "environment_error"
    SESSION_BUSY = "session_busy"
    SERVER_FULL = "server_full"
    SERVER_DRAINING = "server_draining"
    SESSION_NOT_FOUND = "session_not_found"
    SESSION_CLOSED = "session_closed"
    SESSION_EVICTED = "session_evicted"


_EXCEPTIONS: dict[str, type[RemoteError]] = {
    ErrorCode.UNKNOWN_TOOL: UnknownToolError,
    ErrorCode.INVALID_ARGUMENTS: InvalidArgumentsError,
    ErrorCode.TOOL_ERROR: ToolCallError,
    ErrorCode.CALL_TIMEOUT: ToolTimeoutError,
    ErrorCode.UNAUTHORIZED: AuthenticationError,
    ErrorCode.UNKNOWN_ENVIRONMENT: UnknownEnvironmentError,
    ErrorCode.SERVER_FULL: ServerFullError,
    ErrorCode.SERVER_DRAINING: ServerDrainingError,
    ErrorCode.SESSION_NOT_FOUND: SessionLostError,
    ErrorCode.SESSION_CLOSED: SessionLostError,
    ErrorCode.SESSION_EVICTED: SessionLostError,
}


def dumps(frame: dict[str, Any]) -> str:
    """Encode a frame as compact JSON text."""
    return json.dumps(frame, separators=(",", ":"), ensure_ascii=False)


_scan = json.decoder.JSONDecoder().scan_once  # type: ignore[attr-defined]  # set in __init__, not in typeshed
_encode_string = json.encoder.encode_basestring  # what dumps writes for a str (ensure_ascii off)


def loads(text: str | bytes) -> Any:
    """Decode JSON text as ``json.loads`` does; raises ``ValueError`` on malformed input.

    Every frame of a session goes through here, so a text that is one JSON value and nothing else is
    scanned directly, without ``json.loads``' Python wrappers (~1 us of a call); anything else
    (bytes, whitespace around the value, errors) goes through ``json.loads``, which words the error."""
    if isinstance(text, str):
        try:
            value, end = _scan(text, 0)
        except Exception:  # not JSON: json.loads raises its own error below
            pass
        else:
            if end == len(text):
                return value
    return json.loads(text)


def error_payload(code: ErrorCode, message: str) -> dict[str, str]:
    """The ``error`` object of a failed reply or ``bye`` frame."""
    return {"code": code.value, "message": message}


def error_reply(request_id: int | None, code: ErrorCode, message: str) -> str:
    """A failed reply frame, encoded."""
    return dumps({"id": request_id, "ok": False, "error": error_payload(code, message)})


def ok_reply(request_id: int, result: Any) -> str:
    """A successful reply frame, encoded (a text result, every tool call's, formatted directly: ~3 us
    less than encoding the frame's dict)."""
    if type(result) is str:
        return f'{{"id":{request_id},"ok":true,"result":{_encode_string(result)}}}'
    return dumps({"id": request_id, "ok": True, "result": result})


def remote_error(error: dict[str, Any]) -> RemoteError:
    """The typed exception for an ``error`` object received from the server."""
    code = str(error.get("code", "unknown"))
    message = str(error.get("message", ""))
    return _EXCEPTIONS.get(code, RemoteError)(code, message)


def render_result(value: object) -> str:
    """The text a tool message carries for a tool's return value (``str()``, as a local loop does)."""
    return value if isinstance(value, str) else str(value)
