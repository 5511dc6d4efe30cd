"""uvicorn's httptools HTTP protocol, each request bounded from its first byte to its last, and a
fast path to ``WebSocketProtocol``.

Limits (``ServerConfig``, read through ``limits_of``) on what a peer can make the server hold
before any route runs:

* ``max_head_bytes``: a request line plus headers larger than this is answered ``431``, counted as
  the bytes arrive (httptools would otherwise buffer a header of any size, at a cost that grows
  faster than its size).
* ``head_timeout``: the longest the server waits on a peer. A connection whose request head is not
  complete this many seconds after it opened (or after the previous response) is dropped; so is one
  whose peer has read less than ``_MIN_READ`` bytes (or all it was sent) in as long while it owes
  a read (the server's write buffer full, or answers left to flush before a close): before, a
  peer that never read a large answer held its connection and the answer forever. A peer that
  reads that much gets another period, so an answer of N bytes is held N / 64 KiB periods at most.
* No request body: every route is a ``GET`` that reads none, so a request that declares one (a
  ``Content-Length`` above 0, or any ``Transfer-Encoding``) is answered ``413`` without a byte of it
  being read. Before, a complete head followed by 1 byte/s of body held its connection for as long
  as the body lasted, and a chunked body's trailer fields were parsed past every limit.
* At most ``_MAX_PIPELINED`` requests wait behind a running one; the next is answered ``429``.
  uvicorn's own pipeline is unbounded: each answer it writes resumes reading, so a peer that sends
  requests and never reads the answers had the server hold them by the million.

A refused request ends its connection: nothing after its head is parsed, its answer goes out after
the answers to the requests before it, and the connection is half-closed, then dropped when the
peer closes, or as a late peer is.

The fast path: uvicorn parses an upgrade request with httptools (a Python callback per header),
rebuilds its bytes and hands them over to be parsed again. When a connection's first read is a
whole, well-formed ``GET`` upgrade request (``_UPGRADE`` below, as strict as httptools on the
request line and header syntax), it goes to the WebSocket protocol as it came, parsed once.
Anything else, plain HTTP or a malformed head included, takes uvicorn's own parser.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import re
import struct
import termios

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from envserver._websocket import WebSocketProtocol
from envserver._wire import http_response, limits_of

# A request line and header fields as RFC 9112 writes them: a token name right before the colon
# (no space), field values of visible characters, spaces and tabs, no obs-fold continuation lines.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]++"  # possessive: nothing to backtrack into
_FIELD = rb"%s:[\t\x20-\x7e\x80-\xff]*+\r\n" % _TOKEN
_UPGRADE_HEAD = re.compile(rb"GET /[\x21-\x7e]*+ HTTP/1\.1\r\n(?:%s)++\r\n" % _FIELD)
_UPGRADE_FIELD = re.compile(rb"\r\nupgrade:[\t ]*websocket[\t ]*\r\n", re.IGNORECASE)
_MAX_PIPELINED = 16  # requests a connection may have waiting behind the one running
_MIN_READ = 64 << 10  # bytes a peer owing a read must take per head_timeout (or all it was sent) to keep going
_OUTQ = getattr(termios, "TIOCOUTQ", None)  # ioctl: bytes in a socket's send queue the peer has not acknowledged
_NO_BODY = b"this server's routes take no request body (Content-Length above 0 or Transfer-Encoding); send none"


class _Refused(Exception):
    """Raised by a parser callback to stop httptools at a refused request: nothing after its head is parsed."""


class _Parser(httptools.HttpRequestParser):
    """httptools' request parser, for which a callback raising ``_Refused`` ends the parse quietly.

    The request is answered already (``UpgradeFastPath._refuse``); uvicorn would take the callback's
    error for a malformed request, answer ``400`` and log it.
    """

    def feed_data(self, data: bytes | bytearray | memoryview[int] | array.array[int]) -> None:
        """Parse ``data``, stopping quietly at a refused request."""
        try:
            super().feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Refused):
                raise


def _unsent(transport: asyncio.Transport) -> int:
    """Bytes written to ``transport`` that the peer has not received: in its buffer and, where the
    system says, in the socket's send queue. The buffer alone would show a reader's progress only
    when the kernel takes more, which it does in large steps (a 4 MiB queue, read at 80 kB/s, took
    ~20 s between steps)."""
    unsent = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if _OUTQ is not None and sock is not None:
        with contextlib.suppress(OSError):
            unsent += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
    return unsent


def _declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request head announces a body: a ``Content-Length`` above 0, or any ``Transfer-Encoding``."""
    return any(name == b"transfer-encoding" or (name == b"content-length" and value.lstrip(b"0"))
               for name, value in headers)


class _PeerDeadlines:
    """The deadlines of one server's connections waiting on their peers, checked by one timer for all.

    A timer per connection (``call_later`` and its ``cancel``) cost ~4 us of a ~400 us session; a
    connection here costs a dict insertion and removal. A late peer is dropped between
    ``head_timeout`` and ``1.25 * head_timeout`` seconds after the wait began.
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
        """``protocol`` no longer waits on its peer, or its connection is gone."""
        self._pending.pop(protocol, None)

    def _sweep(self) -> None:
        now = self._loop.time()
        for protocol in [p for p, deadline in self._pending.items() if deadline <= now]:
            del self._pending[protocol]
            protocol.peer_timed_out()
        self._timer = self._loop.call_later(self._timeout / 4, self._sweep) if self._pending else None


class UpgradeFastPath(HttpToolsProtocol):
    """uvicorn's httptools HTTP protocol with request limits, handing well-formed upgrades straight over."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.parser = _Parser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn sets its own
        limits = limits_of(self.config)
        self._max_head = limits.max_head_bytes
        self._in_head = True  # a request head has begun or is expected, and is not complete yet
        self._head_bytes = 0
        deadlines = getattr(self.server_state, "toolgym_peer_deadlines", None)
        if deadlines is None:  # one per server (its connections share the server state and the loop)
            deadlines = _PeerDeadlines(self.loop, limits.head_timeout)
            self.server_state.toolgym_peer_deadlines = deadlines  # type: ignore[attr-defined]
        self._deadlines: _PeerDeadlines = deadlines
        self._refused = False  # a request was refused: what the peer sends from now on is discarded
        self._refusal: bytes | None = None  # its answer, while answers to requests before it are due
        self._unsent = 0  # bytes the peer had not received when its deadline started (``_unsent``)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the head deadline as the connection opens."""
        super().connection_made(transport)
        self._deadlines.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        """Drop the deadline with the connection."""
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
                self._refuse(431, b"request head larger than %d bytes (max_head_bytes)" % self._max_head)
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

    def _refuse(self, status: int, body: bytes) -> None:
        """Refuse the request being read: nothing more is read, and ``status`` is answered as soon as
        the answers to the requests before it are out."""
        self._deadlines.discard(self)
        self._in_head, self._refused = False, True
        answer = http_response(status, list(self.server_state.default_headers), body)
        if self.cycle is None or self.cycle.response_complete:
            self._answer_refusal(answer)
        else:
            self._refusal = answer

    def _answer_refusal(self, answer: bytes) -> None:
        """Answer the refused request, then half-close: closing with unread bytes would reset the
        connection, and the peer could lose the answer. The peer's EOF, or its deadline, end it."""
        self._refusal = None
        self._unset_keepalive_if_required()
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._wait_on_peer()

    # httptools callbacks: a head ends with its headers; the next one may begin after the message.

    def on_headers_complete(self) -> None:
        """The head is complete: its deadline and byte count end here. A request that declares a body,
        or one more than ``_MAX_PIPELINED`` behind the running one, is refused instead of run."""
        self._in_head = False
        self._deadlines.discard(self)
        if not (self.parser.should_upgrade() and self._should_upgrade()):
            if _declares_body(self.headers):
                self._refuse(413, _NO_BODY)
                raise _Refused
            if len(self.pipeline) >= _MAX_PIPELINED:
                self._refuse(429, b"more than %d requests pipelined on one connection; wait for the answers"
                             % _MAX_PIPELINED)
                raise _Refused
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        """Whatever comes next is the head of another request."""
        self._in_head = True
        self._head_bytes = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """The peer's turn again: to send its next head, or to read the answer before the connection
        closes; a refused request waiting for this answer gets its own now."""
        super().on_response_complete()
        if self._refusal is not None and self.cycle.response_complete and not self.transport.is_closing():
            self._answer_refusal(self._refusal)
        else:
            self._wait_on_peer()

    def pause_writing(self) -> None:
        """The write buffer is full: the peer has ``head_timeout`` seconds to read some of it."""
        super().pause_writing()
        self._wait_on_peer()

    def _wait_on_peer(self) -> None:
        """Start the peer's deadline, noting how much is left to write (a peer that reads gets more time)."""
        self._unsent = _unsent(self.transport)
        self._deadlines.add(self)

    def _waits_on_peer(self) -> bool:
        """Whether only the peer can move the connection on: by sending a head, reading, or closing."""
        if self.transport.is_closing() or self.flow.write_paused:
            return True
        if self._refused:
            return self._refusal is None  # answered: the peer is to read the answer and close
        return self._in_head and (self.cycle is None or self.cycle.response_complete)

    def peer_timed_out(self) -> None:
        """The deadline passed (``_PeerDeadlines``): drop the connection, with whatever it has left to
        write, if it still waits on the peer and the peer has not read ``_MIN_READ`` bytes (or all it
        had) since the deadline began. A peer whose receive buffer merely filled (2 KiB here) once
        got a second period."""
        if not self._waits_on_peer():
            return
        if self._unsent - _unsent(self.transport) >= min(_MIN_READ, self._unsent) > 0:  # the peer reads
            self._wait_on_peer()  # another period (one that read all it had gets a whole one for its head)
            return
        self.transport.abort()
