"""Bearer-token check on every route, HTTP and WebSocket alike, as one ASGI middleware."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from sdk.protocol import ErrorCode, error_payload


class BearerAuth:
    """Refuses any request whose ``Authorization`` header is not ``Bearer <token>`` with HTTP 401.

    The scheme is matched without regard to case (RFC 9110 section 11.1: ``bearer`` is ``Bearer``),
    the token exactly, in constant time. A request with more than one ``Authorization`` header is
    refused: which one counts would be up to the parser. WebSocket handshakes are refused before
    ``accept`` with the same 401 response (the ASGI "websocket denial response" extension), so an
    unauthenticated client never gets a session.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = token.encode()

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
        values = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, credentials = values[0].partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.lstrip(b" "), self._expected)
