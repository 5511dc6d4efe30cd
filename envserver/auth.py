"""Bearer-token check on every route, HTTP and WebSocket alike, as one ASGI middleware."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from sdk.protocol import ErrorCode, error_payload


class BearerAuth:
    """Refuses any request whose ``Authorization`` header is not ``Bearer <token>`` with HTTP 401.

    WebSocket handshakes are refused before ``accept`` with the same 401 response (the ASGI
    "websocket denial response" extension), so an unauthenticated client never gets a session.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": error_payload(ErrorCode.UNAUTHORIZED, "missing or wrong bearer token")}).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b'Bearer realm="toolgym"'),
                   (b"content-length", str(len(body)).encode())]
        prefix = "websocket.http." if scope["type"] == "websocket" else "http."
        await send({"type": prefix + "response.start", "status": 401, "headers": headers})
        await send({"type": prefix + "response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False
