"""Every hosted environment as an OpenEnv 0.10 environment, at base URL ``/openenv/NAME``.

OpenEnv's clients (``GenericEnvClient``, ``MCPToolClient``) and toolgym's ``sdk.OpenEnvEnvironment``
drive it as they drive OpenEnv's own server:

* ``WS /openenv/NAME/ws``: one session per connection, frames ``reset`` (``data``: the reset
  keyword arguments), ``step`` (``data``: OpenEnv's call-tool action ``{"type": "call_tool",
  "tool_name", "arguments"}``, ``{"type": "list_tools"}``, or, for an environment with a tool named
  ``step``, that tool's arguments), ``state``, ``mcp`` (a JSON-RPC request: ``tools/list``,
  ``tools/call``) and ``close``; each answered by one frame, in order.
* ``WS /openenv/NAME/mcp``: JSON-RPC frames only, one session per connection.
* HTTP: ``GET /health``, ``/metadata``, ``/schema``, ``/state``; ``POST /reset``, ``/step`` (each on
  a fresh instance, as OpenEnv's are) and ``/mcp`` (JSON-RPC).

A reset's observation is ``{"prompt": text}``; a tool call's is OpenEnv's ``CallToolObservation``
(``tool_name``, ``result`` with the text as ``content`` and ``data``, or ``error``), with the
environment's ``get_reward()`` after the call as its reward. toolgym environments have no ``done``:
it is always false. The bearer token, the session limits (``max_sessions``: ``CAPACITY_REACHED``),
``call_timeout``, the idle timeout and the metrics apply as to our own sessions. OpenEnv sessions
cannot resume: a dropped connection ends its session.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from envserver import _jsonrpc
from envserver._faces import (
    HTTP_PEER,
    BodyTooLarge,
    FaceConnection,
    find_session,
    split_route,
    unknown_environment,
)
from envserver.connection import _describe, _RequestError
from envserver.registry import EnvSpec
from envserver.sessions import Refused, Session
from sdk import protocol
from sdk.protocol import ErrorCode

logger = logging.getLogger("envserver.openenv")

PREFIX = "/openenv/"

# Our failures of a tool call as OpenEnv's ToolError types; any other code is an error frame.
_TOOL_ERROR_TYPES = {ErrorCode.UNKNOWN_TOOL: "tool_not_found", ErrorCode.INVALID_ARGUMENTS: "invalid_args",
                     ErrorCode.TOOL_ERROR: "execution_error", ErrorCode.CALL_TIMEOUT: "timeout"}
_FRAME_CODES = {ErrorCode.SERVER_DRAINING: "SESSION_ERROR", ErrorCode.SESSION_BUSY: "EXECUTION_ERROR",
                ErrorCode.ENVIRONMENT_ERROR: "EXECUTION_ERROR", ErrorCode.BAD_FRAME: "VALIDATION_ERROR"}

CALL_TOOL_SCHEMA: dict[str, Any] = {
    "title": "CallToolAction", "type": "object", "additionalProperties": False,
    "description": "Call one of the environment's tools (tools/list names them, with their input schemas).",
    "properties": {"type": {"const": "call_tool", "default": "call_tool", "type": "string"},
                   "tool_name": {"type": "string", "description": "Name of the tool to call"},
                   "arguments": {"type": "object", "description": "Arguments to pass to the tool"},
                   "metadata": {"type": "object"}},
    "required": ["tool_name"],
}
OBSERVATION_SCHEMA: dict[str, Any] = {
    "title": "CallToolObservation", "type": "object",
    "properties": {"done": {"type": "boolean"}, "reward": {"type": ["number", "null"]},
                   "metadata": {"type": "object"}, "tool_name": {"type": "string"}, "result": {},
                   "error": {"type": ["object", "null"]}, "prompt": {"type": ["string", "null"]}},
}
STATE_SCHEMA: dict[str, Any] = {
    "title": "State", "type": "object",
    "properties": {"episode_id": {"type": ["string", "null"]}, "step_count": {"type": "integer", "minimum": 0}},
}


def error_frame(code: str, message: str) -> str:
    """An OpenEnv ``error`` frame."""
    return protocol.dumps({"type": "error", "data": {"message": message, "code": code}})


def _observation(observation: dict[str, Any], reward: float | None = None) -> dict[str, Any]:
    return {"observation": {**observation, "metadata": {}}, "reward": reward, "done": False}


class OpenEnvSocket(FaceConnection):
    """One OpenEnv WebSocket (``/ws``, or ``/mcp`` with bare JSON-RPC frames) and its session."""

    steps = 0
    rpc_only = False

    async def serve(self, env_name: str) -> None:
        """Refuse an unknown environment, else accept, open a session and answer frames until the end."""
        if (await self._receive())["type"] != "websocket.connect":
            return
        table = self.table
        spec = table.specs.get(env_name)
        if spec is None:
            await self.refuse_handshake(404, unknown_environment(env_name, table.specs))
            return
        await self._asgi_send({"type": "websocket.accept"})
        owned = "session_id" not in self.query
        session = await self._open(spec) if owned else await self._existing(spec)
        if session is None:
            return
        await table.attach(session, self)
        try:
            # A task of its own, as Connection does: each wake-up resumes only the frame loop.
            await asyncio.get_running_loop().create_task(self._frames(session))
        finally:
            if session.alive and owned:  # OpenEnv cannot resume: the session ends with its connection
                await table.end(session, "closed")
            elif session.alive:  # a session made over HTTP lives on until its HTTP close
                table.detach(session, self)
                await table.attach(session, HTTP_PEER)

    async def _existing(self, spec: EnvSpec) -> Session | None:
        """The session an HTTP ``openenv/session/create`` made, named by ``?session_id=``."""
        session = find_session(self.table, spec, self.query.get("session_id"))
        if session is None:
            await self._last_word("SESSION_ERROR", f"Unknown session_id: {self.query.get('session_id')}")
        return session

    async def _open(self, spec: EnvSpec) -> Session | None:
        try:
            return await self.table.open(spec)
        except Refused as exc:
            code = "CAPACITY_REACHED" if exc.code == ErrorCode.SERVER_FULL else "SESSION_ERROR"
            await self._last_word(code, str(exc))
        except Exception as exc:
            logger.exception("constructing %s failed", spec.name)
            await self._last_word("FACTORY_ERROR", f"environment constructor raised {_describe(exc)}")
        return None

    async def bye(self, code: ErrorCode, message: str) -> None:
        """The server ends the session (idle, drain, takeover): an error frame, then the close."""
        if not self._closed:
            await self._last_word("SESSION_ERROR", f"{code.value}: {message}")

    async def _last_word(self, code: str, message: str) -> None:
        if self.rpc_only:
            await self._send(protocol.dumps(_jsonrpc.error(None, _jsonrpc.SERVER_ERROR, message)))
        else:
            await self._send(error_frame(code, message))
        await self._close_socket()

    async def _frames(self, session: Session) -> None:
        receive, limit = self._receive, self.table.config.max_frame_bytes
        while session.alive and not self._closed:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                reply: str | None = error_frame("INVALID_JSON", "binary frames are not supported; send JSON text")
            elif len(text) > limit or len(text.encode()) > limit:
                reply = error_frame("VALIDATION_ERROR", f"frame larger than {limit} bytes (max_frame_bytes)")
            else:
                reply = await (self._rpc_frame if self.rpc_only else self._frame)(session, text)
            if reply is not None:
                await self._send(reply)
            if not session.alive and not self._closed:  # the frame was `close`
                await self._close_socket()

    async def _rpc_frame(self, session: Session, text: str) -> str | None:
        try:
            request = protocol.loads(text)
        except (ValueError, RecursionError) as exc:
            return protocol.dumps(_jsonrpc.error(None, _jsonrpc.PARSE_ERROR, f"Parse error: {exc}"))
        response = await _jsonrpc.dispatch(self, session, request, openenv=True)
        return None if response is None else protocol.dumps(response)

    async def _frame(self, session: Session, text: str) -> str | None:
        try:
            message = protocol.loads(text)
        except (ValueError, RecursionError) as exc:
            return error_frame("INVALID_JSON", f"Invalid JSON: {exc}")
        kind = message.get("type") if isinstance(message, dict) else None
        handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
        if handler is None:
            return error_frame("UNKNOWN_TYPE",
                               f"Unknown message type: {kind!r}; expected one of {', '.join(_HANDLERS)}")
        data = message.get("data", {})
        if not isinstance(data, dict):
            return error_frame("VALIDATION_ERROR", "'data' must be a JSON object")
        try:
            return await handler(self, session, data)
        except _RequestError as exc:
            return error_frame(_FRAME_CODES.get(exc.code, "EXECUTION_ERROR"), str(exc))

    async def _on_reset(self, session: Session, data: dict[str, Any]) -> str:
        prompt = await self.reset(session, data)
        self.steps = 0
        return protocol.dumps({"type": "observation", "data": _observation({"prompt": prompt})})

    async def _on_step(self, session: Session, data: dict[str, Any]) -> str:
        observation = await step(self, session, data)
        self.steps += 1
        return protocol.dumps({"type": "observation", "data": observation})

    async def _on_state(self, session: Session, data: dict[str, Any]) -> str:
        return protocol.dumps({"type": "state", "data": {"episode_id": None, "step_count": self.steps}})

    async def _on_mcp(self, session: Session, data: dict[str, Any]) -> str:
        response = await _jsonrpc.dispatch(self, session, data, openenv=True)
        if response is None:  # a notification: OpenEnv still answers every frame
            response = _jsonrpc.result(None, {})
        return protocol.dumps({"type": "mcp", "data": response})

    async def _on_close(self, session: Session, data: dict[str, Any]) -> None:
        await self.table.end(session, "closed")


_Handler = Callable[[OpenEnvSocket, Session, dict[str, Any]], Awaitable[str | None]]
_HANDLERS: dict[str, _Handler] = {"reset": OpenEnvSocket._on_reset, "step": OpenEnvSocket._on_step,
                             "state": OpenEnvSocket._on_state, "mcp": OpenEnvSocket._on_mcp,
                             "close": OpenEnvSocket._on_close}


async def step(conn: FaceConnection, session: Session, action: dict[str, Any]) -> dict[str, Any]:
    """One OpenEnv step on ``session``: a tool call (the reward after it), or the tool list.

    Raises:
        _RequestError: the action is not one this environment takes (``bad_frame``), or the session
            cannot run it now.
    """
    spec = session.spec
    kind = action.get("type")
    if kind == "list_tools":
        tools = [{"name": t["name"], "description": t["description"], "input_schema": t["inputSchema"]}
                 for t in _jsonrpc.mcp_tools(spec)]
        return _observation({"tools": tools})
    if kind == "call_tool":
        name, arguments = action.get("tool_name"), action.get("arguments") or {}
    elif "step" in spec.tools:  # an action-style client: the action's fields are the step tool's arguments
        name, arguments = "step", {k: v for k, v in action.items() if k != "metadata"}
    else:
        raise _RequestError(ErrorCode.BAD_FRAME, "this environment takes OpenEnv's call-tool action "
                            '{"type": "call_tool", "tool_name": ..., "arguments": {...}} or {"type": "list_tools"}')
    if not isinstance(name, str):
        raise _RequestError(ErrorCode.BAD_FRAME, "a call_tool action needs a string 'tool_name'")
    try:
        text, reward = await conn.call_and_reward(session, name, arguments)
    except _RequestError as exc:
        error_type = _TOOL_ERROR_TYPES.get(exc.code)
        if error_type is None:
            raise
        return _observation({"tool_name": name, "result": None, "error": {"error_type": error_type,
                                                                          "message": str(exc)}})
    return _observation({"tool_name": name, "result": _jsonrpc.openenv_result(text), "error": None}, reward)


class OpenEnvHttp(FaceConnection):
    """One plain-HTTP request to an environment's OpenEnv routes."""

    async def answer(self, env_name: str, route: str) -> None:
        """Answer the request; POST routes work on a session of their own, ended after the answer."""
        table = self.table
        spec = table.specs.get(env_name)
        if spec is None:
            await self.respond(404, {"detail": unknown_environment(env_name, table.specs)})
            return
        method = self.scope["method"]
        if method == "GET" and route in _GET_ROUTES:
            status, body = _GET_ROUTES[route](table.draining, spec)
            await self.respond(status, body)
            return
        if method != "POST" or route not in ("/reset", "/step", "/mcp"):
            await self.respond(404 if method in ("GET", "POST") else 405,
                               {"detail": f"no route {method} {PREFIX}{env_name}{route}; OpenEnv's routes are GET "
                                          "/health /metadata /schema /state, POST /reset /step /mcp, WS /ws /mcp"})
            return
        try:
            body = json.loads(await self.read_body() or b"{}")
        except BodyTooLarge as exc:
            await self.respond(413, {"detail": str(exc)})
            return
        except (ValueError, RecursionError) as exc:
            await self.respond(400 if route != "/mcp" else 200, {"detail": f"invalid JSON: {exc}"} if route != "/mcp"
                               else _jsonrpc.error(None, _jsonrpc.PARSE_ERROR, f"Parse error: {exc}"))
            return
        await self._run_once(spec, route, body)

    async def _run_once(self, spec: EnvSpec, route: str, body: Any) -> None:
        table = self.table
        params = body.get("params") if isinstance(body, dict) else None
        if route == "/mcp" and isinstance(body, dict) and (str(body.get("method")).startswith("openenv/session/")
                                                           or (isinstance(params, dict) and "session_id" in params)):
            await self.respond(200, await self._session_rpc(spec, body))
            return
        try:
            session = await table.open(spec)
        except Refused as exc:
            await self.respond(503, {"detail": str(exc)})
            return
        try:
            if route == "/mcp":
                await self.respond(200, await _jsonrpc.dispatch(self, session, body, openenv=True))
            elif not isinstance(body, dict):
                await self.respond(422, {"detail": "the body must be a JSON object"})
            elif route == "/reset":
                prompt = await self.reset(session, {k: v for k, v in body.items() if v is not None})
                await self.respond(200, _observation({"prompt": prompt}))
            else:
                await self.respond(200, await step(self, session, body.get("action") or {}))
        except _RequestError as exc:
            await self.respond(422 if exc.code == ErrorCode.BAD_FRAME else 500, {"detail": str(exc)})
        finally:
            await table.end(session, "closed")


    async def _session_rpc(self, spec: EnvSpec, request: dict[str, Any]) -> dict[str, Any] | None:
        """OpenEnv's HTTP MCP sessions: ``openenv/session/create`` and ``close``, and the tools methods
        on the session named by ``params.session_id`` (OpenEnv's ``MCPToolClient`` drives them, with
        ``WS /ws?session_id=`` for reset and step on the same session)."""
        rid, method, params = request.get("id"), request.get("method"), request.get("params")
        params = params if isinstance(params, dict) else {}
        table = self.table
        if method == "openenv/session/create":
            try:
                session = await table.open(spec)
            except Refused as exc:
                return _jsonrpc.error(rid, _jsonrpc.SERVER_ERROR, str(exc))
            except Exception as exc:
                logger.exception("constructing %s failed", spec.name)
                return _jsonrpc.error(rid, _jsonrpc.SERVER_ERROR, f"environment constructor raised {_describe(exc)}")
            await table.attach(session, HTTP_PEER)
            return _jsonrpc.result(rid, {"session_id": session.id})
        found = find_session(table, spec, params.get("session_id"))
        if found is None:
            return _jsonrpc.error(rid, _jsonrpc.INVALID_PARAMS, f"Unknown session_id: {params.get('session_id')}")
        if method == "openenv/session/close":
            await table.end(found, "closed")
            return _jsonrpc.result(rid, {"session_id": found.id, "closed": True})
        return await _jsonrpc.dispatch(self, found, request, openenv=True)


def _health(draining: bool, spec: EnvSpec) -> tuple[int, dict[str, Any]]:
    return (503, {"status": "unhealthy"}) if draining else (200, {"status": "healthy"})


def _metadata(draining: bool, spec: EnvSpec) -> tuple[int, dict[str, Any]]:
    factory = getattr(spec.factory, "func", spec.factory)
    doc = inspect.getdoc(factory if isinstance(factory, type) else type(factory)) or f"toolgym environment {spec.name}"
    return 200, {"name": spec.name, "description": doc.splitlines()[0], "readme_content": None, "version": None,
                 "author": None, "documentation_url": None}


def _schema(draining: bool, spec: EnvSpec) -> tuple[int, dict[str, Any]]:
    return 200, {"action": CALL_TOOL_SCHEMA, "observation": OBSERVATION_SCHEMA, "state": STATE_SCHEMA}


def _state(draining: bool, spec: EnvSpec) -> tuple[int, dict[str, Any]]:
    return 200, {"episode_id": None, "step_count": 0}


_GET_ROUTES = {"/health": _health, "/metadata": _metadata, "/schema": _schema, "/state": _state}


async def serve_openenv(scope: Any, receive: Any, send: Any, table: Any) -> None:
    """Route a request under ``/openenv/`` to its socket or HTTP handler."""
    env_name, route = split_route(scope["path"], PREFIX)
    if scope["type"] == "websocket":
        socket = OpenEnvSocket(scope, receive, send, table)
        if route not in ("/ws", "/mcp"):
            await receive()
            await socket.refuse_handshake(404, f"no WebSocket route {route!r}; OpenEnv's are /ws and /mcp")
            return
        socket.rpc_only = route == "/mcp"
        await socket.serve(env_name)
    else:
        await OpenEnvHttp(scope, receive, send, table).answer(env_name, route)
