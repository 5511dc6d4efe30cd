"""Every hosted environment as a streamable-HTTP MCP server at ``/mcp/NAME``; an MCP session is a session.

MCP's streamable HTTP transport (the initialize handshake, revisions 2024-11-05 to 2025-11-25),
answered with JSON, never an event stream:

* ``POST /mcp/NAME`` with ``initialize`` opens a session of the environment (``max_sessions`` and
  the wait queue apply; refused: HTTP 503) and answers with its id in ``Mcp-Session-Id``. Every later
  message carries that header: requests (``tools/list``, ``tools/call``, ``ping``) are answered
  with their JSON-RPC response, notifications and responses with ``202``. A session id the server
  does not know (closed, reaped after ``idle_timeout``, a restart) gets ``404``: initialize again.
* ``DELETE /mcp/NAME`` ends the session (the environment's ``close()`` runs); ``GET`` (a stream
  for server-initiated messages) is ``405``: this server sends none.

Requests of one session run one at a time, under ``call_timeout``, counted in the metrics, behind
the bearer token. The episode is the session's: an MCP client has no ``reset``, so the environment's
``reset`` runs once when the session opens (with no arguments).
"""

from __future__ import annotations

import logging
from typing import Any

from envserver import _jsonrpc
from envserver._faces import HTTP_PEER, BodyTooLarge, FaceConnection, find_session, split_route, unknown_environment
from envserver.connection import _describe, _RequestError
from envserver.registry import EnvSpec
from envserver.sessions import Refused
from sdk import protocol

logger = logging.getLogger("envserver.mcp")

PREFIX = "/mcp/"
SESSION_HEADER = b"mcp-session-id"


class McpHttp(FaceConnection):
    """One HTTP request to an environment's MCP endpoint."""

    async def answer(self, env_name: str) -> None:
        """Route the request by method."""
        table = self.table
        spec = table.specs.get(env_name)
        if spec is None:
            await self.respond(404, _jsonrpc.error(None, _jsonrpc.INVALID_REQUEST,
                                                   unknown_environment(env_name, table.specs)))
            return
        method = self.scope["method"]
        if method == "POST":
            await self._post(spec)
        elif method == "DELETE":
            session = find_session(table, spec, self._session_id())
            if session is not None:
                await table.end(session, "closed")
            await self.respond(200 if session is not None else 404, None)
        else:
            await self.respond(405, None, [(b"allow", b"POST, DELETE")])

    def _session_id(self) -> str | None:
        values = [value for name, value in self.scope["headers"] if name == SESSION_HEADER]
        return values[0].decode("latin-1") if len(values) == 1 else None

    async def _post(self, spec: EnvSpec) -> None:
        try:
            message = protocol.loads(await self.read_body())
        except BodyTooLarge as exc:
            await self.respond(413, _jsonrpc.error(None, _jsonrpc.INVALID_REQUEST, str(exc)))
            return
        except (ValueError, RecursionError) as exc:
            await self.respond(400, _jsonrpc.error(None, _jsonrpc.PARSE_ERROR, f"Parse error: {exc}"))
            return
        if not isinstance(message, dict):
            await self.respond(400, _jsonrpc.error(None, _jsonrpc.INVALID_REQUEST,
                                                   "send one JSON-RPC message per request (no batches)"))
            return
        if message.get("method") == "initialize":
            await self._initialize(spec, message)
            return
        session_id = self._session_id()
        if session_id is None:
            await self._sessionless(message)
            return
        session = find_session(self.table, spec, session_id)
        if session is None:
            await self.respond(404, _jsonrpc.error(message.get("id"), _jsonrpc.INVALID_REQUEST,
                                                   "no such MCP session (closed, idle past idle_timeout, or the "
                                                   "server restarted): send initialize again"))
            return
        if "method" not in message or "id" not in message:  # a notification, or a response to the server
            await self.respond(202, None)
            return
        await self.respond(200, await _jsonrpc.dispatch(self, session, message))

    async def _initialize(self, spec: EnvSpec, message: dict[str, Any]) -> None:
        rid, params = message.get("id"), message.get("params")
        table = self.table
        try:
            session = await table.open(spec)
        except Refused as exc:
            await self.respond(503, _jsonrpc.error(rid, _jsonrpc.SERVER_ERROR, f"{exc.code.value}: {exc}"))
            return
        except Exception as exc:
            logger.exception("constructing %s failed", spec.name)
            await self.respond(500, _jsonrpc.error(rid, _jsonrpc.SERVER_ERROR,
                                                   f"environment constructor raised {_describe(exc)}"))
            return
        await table.attach(session, HTTP_PEER)
        try:
            await self.reset(session, {})
        except _RequestError as exc:
            await table.end(session, "closed")
            await self.respond(500, _jsonrpc.error(rid, _jsonrpc.SERVER_ERROR,
                                                   f"the environment's reset failed: {exc}"))
            return
        requested = params.get("protocolVersion") if isinstance(params, dict) else None
        await self.respond(200, _jsonrpc.result(rid, _jsonrpc.server_info(spec, requested)),
                           [(SESSION_HEADER, session.id.encode())])

    async def _sessionless(self, message: dict[str, Any]) -> None:
        """A message without a session: ``ping`` is answered, anything else needs ``initialize`` first."""
        rid = message.get("id")
        if message.get("method") == "ping" and "id" in message:
            await self.respond(200, _jsonrpc.result(rid, {}))
        elif message.get("method") == "server/discover":  # the 2026 era's probe: this server speaks the handshake
            await self.respond(200, _jsonrpc.error(rid, _jsonrpc.METHOD_NOT_FOUND,
                                                   "server/discover: this server speaks the initialize handshake"))
        else:
            await self.respond(400, _jsonrpc.error(rid, _jsonrpc.INVALID_REQUEST,
                                                   "no Mcp-Session-Id header: send initialize first"))


async def serve_mcp(scope: Any, receive: Any, send: Any, table: Any) -> None:
    """Route an HTTP request under ``/mcp/NAME`` (a WebSocket there is refused)."""
    env_name, route = split_route(scope["path"], PREFIX)
    handler = McpHttp(scope, receive, send, table)
    if scope["type"] != "http":
        await receive()
        await handler.refuse_handshake(404, "MCP here is streamable HTTP: POST JSON-RPC to /mcp/NAME")
    elif route not in ("", "/"):
        await handler.respond(404, _jsonrpc.error(None, _jsonrpc.INVALID_REQUEST,
                                                  f"no MCP endpoint at {scope['path']}"))
    else:
        await handler.answer(env_name)
