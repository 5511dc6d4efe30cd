"""uvicorn's httptools HTTP protocol with request-head limits and a fast path to ``WebSocketProtocol``.

Limits (``ServerConfig``, read through ``limits_of``) on what a peer sends before any route runs:

* ``max_head_bytes``: a request line plus headers larger than this is answered ``431`` and the
  connection closed, counted as the bytes arrive (httptools would otherwise buffer a header of any
  size, at a cost that grows faster than its size).
* ``head_timeout``: a connection whose request head is not complete this many seconds after it
  opened (or after the previous response) is closed: a slowloris peer holds a socket for seconds,
  not forever.

The fast path: uvicorn parses an upgrade request with httptools (a Python callback per header),
rebuilds its bytes and hands them over to be parsed again. When a connection's first read is a
whole, well-formed ``GET`` upgrade request (``_UPGRADE`` below, as strict as httptools on the
request line and header syntax), it goes to the WebSocket protocol as it came, parsed once.
Anything else, plain HTTP or a malformed head included, takes uvicorn's own parser.
"""

from __future__ import annotations

import asyncio
import re

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from envserver._websocket import WebSocketProtocol
from envserver._wire import http_response, limits_of

# A request line and header fields as RFC 9112 writes them: a token name right before the colon
# (no space), field values of visible characters, spaces and tabs, no obs-fold continuation lines.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]++"  # possessive: nothing to backtrack into
_FIELD = rb"%s:[\t\x20-\x7e\x80-\xff]*+\r\n" % _TOKEN
_UPGRADE_HEAD = re.compile(rb"GET /[\x21-\x7e]*+ HTTP/1\.1\r\n(?:%s)++\r\n" % _FIELD)
_UPGRADE_FIELD = re.compile(rb"\r\nupgrade:[\t ]*websocket[\t ]*\r\n", re.IGNORECASE)
_REFUSED_LINGER = 2.0  # seconds a refused connection stays half-open for the peer to read the answer


class _HeadDeadlines:
    """The head deadlines of one server's connections, checked by one timer for all of them.

    A timer per connection (``call_later`` and its ``cancel``) cost ~4 us of a ~400 us session; a
    connection here costs a dict insertion and removal. A late head is closed between
    ``head_timeout`` and ``1.25 * head_timeout`` seconds after it began.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._loop = loop
        self._timeout = timeout
        self._pending: dict[UpgradeFastPath, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, protocol: UpgradeFastPath) -> None:
        """Start (or restart) ``protocol``'s deadline."""
        self._pending[protocol] = self._loop.time() + self._timeout
        if self._timer is None:
            self._timer = self._loop.call_later(self._timeout / 4, self._sweep)

    def discard(self, protocol: UpgradeFastPath) -> None:
        """``protocol``'s head is complete, or its connection gone."""
        self._pending.pop(protocol, None)

    def _sweep(self) -> None:
        now = self._loop.time()
        for protocol in [p for p, deadline in self._pending.items() if deadline <= now]:
            del self._pending[protocol]
            protocol.head_timed_out()
        self._timer = self._loop.call_later(self._timeout / 4, self._sweep) if self._pending else None


class UpgradeFastPath(HttpToolsProtocol):
    """uvicorn's httptools HTTP protocol with head limits, handing well-formed upgrades straight over."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        limits = limits_of(self.config)
        self._max_head = limits.max_head_bytes
        self._in_head = True  # a request head has begun or is expected, and is not complete yet
        self._head_bytes = 0
        deadlines = getattr(self.server_state, "toolgym_head_deadlines", None)
        if deadlines is None:  # one per server (its connections share the server state and the loop)
            deadlines = _HeadDeadlines(self.loop, limits.head_timeout)
            self.server_state.toolgym_head_deadlines = deadlines  # type: ignore[attr-defined]
        self._deadlines: _HeadDeadlines = deadlines
        self._refused = False  # answered 431: what the peer sends from now on is discarded

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the head deadline as the connection opens."""
        super().connection_made(transport)
        self._deadlines.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        """Drop the head deadline with the connection."""
        self._deadlines.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Count head bytes against the limit; hand a whole upgrade request over at once; else parse."""
        if self._refused:
            return
        if self._in_head:
            if (self.cycle is None and self.ws_protocol_class is WebSocketProtocol
                    and len(data) <= self._max_head and _UPGRADE_HEAD.fullmatch(data) is not None
                    and _UPGRADE_FIELD.search(data) is not None):
                self._hand_over(data)
                return
            end = data.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else end + 4
            if self._head_bytes > self._max_head:
                self._refuse_head()
                return
        super().data_received(data)

    def _hand_over(self, data: bytes) -> None:
        self._deadlines.discard(self)
        self.connections.discard(self)
        self._unset_keepalive_if_required()
        protocol = WebSocketProtocol(self.config, self.server_state, self.app_state, self.loop)
        protocol.connection_made(self.transport)
        protocol.data_received(data)
        self.transport.set_protocol(protocol)

    def _refuse_head(self) -> None:
        """Answer 431, then half-close: closing with unread bytes would reset the connection, and the
        peer could lose the answer. The peer's EOF, or ``_REFUSED_LINGER`` seconds, end it."""
        self._deadlines.discard(self)
        self._in_head, self._refused = False, True
        body = b"request head larger than %d bytes (max_head_bytes)" % self._max_head
        self.transport.write(http_response(431, list(self.server_state.default_headers), body))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_REFUSED_LINGER, self.transport.close)

    # httptools callbacks: a head ends with its headers; the next one may begin after the message.

    def on_headers_complete(self) -> None:
        """The head is complete: its deadline and byte count end here."""
        self._in_head = False
        self._deadlines.discard(self)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        """Whatever comes next is the head of another request."""
        self._in_head = True
        self._head_bytes = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """A keep-alive connection waits for its next head under the deadline again."""
        super().on_response_complete()
        if self._in_head and not self.transport.is_closing():
            self._deadlines.add(self)

    def head_timed_out(self) -> None:
        """The head deadline passed (``_HeadDeadlines``): close, unless a response is still being written."""
        if self._in_head and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()
