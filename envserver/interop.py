"""The server's faces for other ecosystems, in front of the app: OpenEnv at ``/openenv/NAME``, MCP at ``/mcp/NAME``.

``InteropFaces`` is ASGI middleware, like the session sockets' (``envserver.app``): requests under
its prefixes go straight to their face, everything else on to the app. It sits behind the bearer-token
check, so a face needs the token as every route does (``docs/interop.md``).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from envserver.mcp import PREFIX as MCP_PREFIX
from envserver.mcp import serve_mcp
from envserver.openenv import PREFIX as OPENENV_PREFIX
from envserver.openenv import serve_openenv
from envserver.sessions import SessionTable


class InteropFaces:
    """ASGI middleware routing ``/openenv/...`` to the OpenEnv face and ``/mcp/...`` to the MCP face."""

    def __init__(self, app: ASGIApp, table: SessionTable) -> None:
        self.app = app
        self.table = table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and path.startswith(OPENENV_PREFIX):
            await serve_openenv(scope, receive, send, self.table)
        elif scope["type"] in ("http", "websocket") and path.startswith(MCP_PREFIX):
            await serve_mcp(scope, receive, send, self.table)
        else:
            await self.app(scope, receive, send)
