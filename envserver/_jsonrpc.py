"""MCP's JSON-RPC 2.0 methods over one session: what both interop faces answer.

``tools/list`` gives the environment's tools (``inputSchema``: the same JSON schema the model sees);
``tools/call`` runs one through the session, a failure the model caused (it raised, bad arguments,
past the deadline) as a result with ``isError`` (MCP's tool execution error, which the model reads),
an unknown tool as the protocol error ``-32602``. ``initialize``, ``ping`` and notifications are the
MCP session's own (the streamable-HTTP face); OpenEnv's ``mcp`` frames use the tools methods.
"""

from __future__ import annotations

from typing import Any

from envserver._faces import FaceConnection
from envserver.connection import _RequestError
from envserver.registry import EnvSpec
from envserver.sessions import Session
from sdk.protocol import ErrorCode

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SERVER_ERROR = -32000

MCP_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
"""MCP protocol revisions this server speaks, newest first (a client asking for another gets the newest)."""

_TOOL_FAILURES = frozenset((ErrorCode.INVALID_ARGUMENTS, ErrorCode.TOOL_ERROR, ErrorCode.CALL_TIMEOUT))


def result(request_id: Any, value: Any) -> dict[str, Any]:
    """A JSON-RPC success response."""
    return {"jsonrpc": "2.0", "id": request_id, "result": value}


def error(request_id: Any, code: int, message: str) -> dict[str, Any]:
    """A JSON-RPC error response."""
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}


def mcp_tools(spec: EnvSpec) -> list[dict[str, Any]]:
    """The environment's tools as MCP ``Tool`` objects."""
    return [{"name": name, "description": info.schema["function"].get("description", ""),
             "inputSchema": info.schema["function"].get("parameters", {"type": "object", "properties": {}})}
            for name, info in spec.tools.items()]


def text_result(text: str, is_error: bool) -> dict[str, Any]:
    """An MCP ``CallToolResult`` carrying one text block."""
    return {"content": [{"type": "text", "text": text}], "isError": is_error}


def openenv_result(text: str) -> dict[str, Any]:
    """A successful call's result as OpenEnv's server writes it (FastMCP's ``CallToolResult``):
    OpenEnv's clients return its ``data``."""
    return {"content": [{"type": "text", "text": text}], "structured_content": None, "data": text, "is_error": False}


def server_info(spec: EnvSpec, requested: object) -> dict[str, Any]:
    """The ``initialize`` result: the protocol revision, the tools capability, the server's name."""
    version = requested if requested in MCP_VERSIONS else MCP_VERSIONS[0]
    return {"protocolVersion": version, "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": {"name": f"toolgym/{spec.name}", "version": "1"},
            "instructions": f"The tools of toolgym environment {spec.name!r}; each MCP session is one episode."}


async def dispatch(conn: FaceConnection, session: Session, request: object,
                   openenv: bool = False) -> dict[str, Any] | None:
    """Answer one JSON-RPC message for ``session``; ``None`` for a notification (no ``id``).

    With ``openenv``, a call's result is in OpenEnv's shape (``openenv_result``) and a tool failure
    the JSON-RPC error OpenEnv's server answers (its clients raise it); else MCP's ``isError`` result.
    """
    if not isinstance(request, dict) or request.get("jsonrpc") != "2.0" or not isinstance(request.get("method"), str):
        return error(request.get("id") if isinstance(request, dict) else None, INVALID_REQUEST,
                     "a JSON-RPC 2.0 request needs 'jsonrpc': '2.0' and a string 'method'")
    rid, method = request.get("id"), request["method"]
    params = request.get("params") or {}
    if "id" not in request:
        return None  # notifications (notifications/initialized, cancelled): nothing to answer
    if not isinstance(params, dict):
        return error(rid, INVALID_PARAMS, "'params' must be an object")
    if method == "initialize":
        return result(rid, server_info(session.spec, params.get("protocolVersion")))
    if method == "ping":
        return result(rid, {})
    if method == "tools/list":
        return result(rid, {"tools": mcp_tools(session.spec)})
    if method == "tools/call":
        return await _call(conn, session, rid, params, openenv)
    return error(rid, METHOD_NOT_FOUND, f"method not found: {method!r} (this server has tools/list and tools/call)")


async def _call(conn: FaceConnection, session: Session, rid: Any, params: dict[str, Any],
                openenv: bool) -> dict[str, Any]:
    name = params.get("name")
    if not isinstance(name, str):
        return error(rid, INVALID_PARAMS, "tools/call needs the tool's 'name'")
    try:
        text = await conn.call_tool(session, name, params.get("arguments") or {})
    except _RequestError as exc:
        if exc.code == ErrorCode.UNKNOWN_TOOL:
            return error(rid, INVALID_PARAMS, str(exc))
        if exc.code in _TOOL_FAILURES and not openenv:
            return result(rid, text_result(str(exc), is_error=True))
        return error(rid, INTERNAL_ERROR if openenv else SERVER_ERROR, f"{exc.code.value}: {exc}")
    return result(rid, openenv_result(text) if openenv else text_result(text, is_error=False))
