"""The HTTP protocol of the server with request bodies on the interop faces' ``POST`` routes only.

``UpgradeFastPath`` answers ``413`` to any request that declares a body: our own routes read none.
The OpenEnv face (``POST /openenv/NAME/reset``, ``/step``, ``/mcp``) and the MCP face (``POST
/mcp/NAME``) take a JSON body, so for those a body is let through when it is bounded before a byte
of it is read: a ``Content-Length`` of at most ``max_frame_bytes`` (never chunked), and the whole body
within ``head_timeout`` seconds of the head's end, else the connection is dropped (a peer sending a
byte a second holds it no longer than a slow head would). Every other request is ``UpgradeFastPath``'s.
"""

from __future__ import annotations

import asyncio

import httptools

from envserver._http import UpgradeFastPath
from envserver._wire import limits_of

BODY_PREFIXES = (b"/openenv/", b"/mcp/")
"""Paths whose ``POST`` requests may carry a bounded body."""


class BodyRoutes(UpgradeFastPath):
    """``UpgradeFastPath`` taking a bounded body on ``POST`` requests under ``BODY_PREFIXES``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        limits = limits_of(self.config)
        self._max_body = limits.max_frame_bytes
        self._body_timeout = limits.head_timeout
        self._body_deadline: asyncio.TimerHandle | None = None

    def on_headers_complete(self) -> None:
        """Let a bounded body through on the faces' ``POST`` routes; the body's deadline starts here."""
        if not self._takes_body():
            super().on_headers_complete()
            return
        headers = self.headers  # the ASGI scope holds this list: it keeps every header
        self.headers = [(name, value) for name, value in headers if name != b"content-length"]
        try:
            super().on_headers_complete()  # sees no declared body: the route reads it
        finally:
            self.headers = headers
        self._body_deadline = self.loop.call_later(self._body_timeout, self._body_late)

    def on_message_complete(self) -> None:
        """The body is whole: its deadline ends."""
        self._cancel_deadline()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        """Drop the body's deadline with the connection."""
        self._cancel_deadline()
        super().connection_lost(exc)

    def _takes_body(self) -> bool:
        if self.parser.get_method() != b"POST" or any(name == b"transfer-encoding" for name, _ in self.headers):
            return False
        lengths = [value for name, value in self.headers if name == b"content-length"]
        if len(lengths) != 1 or not lengths[0].isdigit() or int(lengths[0]) > self._max_body:
            return False
        return bool(httptools.parse_url(self.url).path.startswith(BODY_PREFIXES))

    def _body_late(self) -> None:
        self._body_deadline = None
        self.transport.abort()  # the route waiting for the body gets http.disconnect

    def _cancel_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None
