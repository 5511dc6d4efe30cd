"""A lean RFC 6455 WebSocket protocol for uvicorn (``uvicorn.Config(ws=WebSocketProtocol)``).

uvicorn's HTTP protocol parses the upgrade request and hands the connection over to this class,
which does the handshake and the framing itself and speaks ASGI ``websocket`` events to the app,
so the bearer-token middleware, the router and ``Connection`` see exactly what uvicorn's own
WebSocket protocols give them. It exists for speed: behind uvicorn's ``websockets`` (sans-I/O)
protocol an upgrade cost ~190 us of CPU (HTTP parsing included), here ~60 us, and the server's
CPU time per short session (open, reset, call, close) fell by about 40 % (``bench/envserver``).

What it does (RFC 6455): the opening handshake (``envserver._handshake``: version 13, ``400`` for
a malformed upgrade, ``426`` for another version), text and binary messages, fragmented or not,
client frames must be masked, control frames (close, ping, pong), the closing handshake, keep-alive pings
(``ws_ping_interval``/``ws_ping_timeout``), messages above ``ws_max_size`` closed with 1009 before
their payload is read, invalid UTF-8 closed with 1007, protocol errors with 1002. Extensions
(permessage-deflate: small JSON frames gain nothing from it) are never negotiated; a subprotocol
only when the app accepts one. ASGI extras: ``websocket.http.response`` (an HTTP response instead
of the handshake, as auth uses) and ``websocket.close`` before ``accept`` (HTTP 403).

Limits on what a peer can make the server hold (``ServerConfig``, read through ``limits_of``):
reading from the socket pauses while the messages queued for the app hold ``max_buffered_bytes``
(or 64 messages), while the transport's write buffer is full (a peer that sends pings and never
reads the pongs), and before the handshake completes; so a connection holds at most about
``max_buffered_bytes`` plus two frames of ``ws_max_size``. A fragmented message must be complete
within ``fragment_timeout`` seconds (else 1008), its text is checked for UTF-8 fragment by
fragment (1007 at the first bad fragment), and it is held as its payload bytes, however many
fragments carry them. One turn of the event loop handles ``_FRAMES_PER_TURN`` frames of a
connection that give the app no message (fragments, pings, pongs) at most, so a flood of tiny
frames does not hold up the others. A closing connection
is dropped ``_CLOSE_TIMEOUT`` seconds after the close began, written bytes the peer never read
included (a transport would otherwise wait for them forever). A protocol error waits (1 s at
most) until the app has read the messages that came before the bad frame, so their replies still
go out before the close frame (Autobahn's "strict" behaviour). While reading is paused because the app is behind,
the keep-alive deadline and the fragment deadline wait: the peer is not the one late.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import logging
import random
from typing import Any, Literal

from uvicorn.config import Config
from uvicorn.protocols.utils import ClientDisconnected, get_local_addr, get_remote_addr, is_ssl
from uvicorn.server import ServerState

from envserver._handshake import Refusal, accept_response, read_upgrade, upgrade_scope
from envserver._wire import VALID_CLOSE, apply_mask, close_frame, frame, http_response, limits_of, utf8_decoder

logger = logging.getLogger("envserver.websocket")

_CONT, _TEXT, _BINARY, _CLOSE, _PING, _PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_CLOSE_TIMEOUT = 10.0  # seconds to wait for the peer's close frame after sending ours
_FAIL_DELAY = 1.0  # seconds a protocol error waits for the app to read the messages before it
_MAX_QUEUED = 64  # messages buffered for the app before reading from the socket pauses
_FRAMES_PER_TURN = 1024  # frames without a message handled per loop turn (~1.5 ms of empty ones)
_State = Literal["handshake", "connecting", "responding", "open", "closed"]


class WebSocketProtocol(asyncio.Protocol):
    """One server-side WebSocket connection, from the upgrade request to the closed socket.

    Built by uvicorn's HTTP protocol with the same arguments as uvicorn's WebSocket protocols; it
    then gets the upgrade request through ``data_received`` and owns the transport.
    """

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not config.loaded:
            config.load()
        self.config = config
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.app_state = app_state
        self.max_size: int = config.ws_max_size
        limits = limits_of(config)
        self._max_buffered = limits.max_buffered_bytes
        self._fragment_timeout = limits.fragment_timeout
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.scope: dict[str, Any] = {}
        self._addresses: tuple[tuple[str, int | None] | None, tuple[str, int] | None, str] = (None, None, "ws")
        self.state: _State = "handshake"
        self.close_sent = False
        self.disconnected = False
        self._buffer = bytearray()  # bytes received and not handled yet
        self._fragments: bytearray | None = None  # the payload of a fragmented message so far
        self._fragment_opcode = _TEXT
        self._fragment_size = 0  # its length (0 between fragmented messages)
        self._frames = 0  # frames that gave the app no message, since reading last paused for them
        self._decoder: codecs.IncrementalDecoder | None = None  # checks a fragmented text's UTF-8 as it comes
        self._events: collections.deque[dict[str, Any]] = collections.deque()
        self._sizes: collections.deque[int] = collections.deque()  # payload bytes of each queued event
        self._queued_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._read_paused = False
        self._writable: asyncio.Event | None = None  # set while the transport's buffer is full
        self._response: tuple[int, list[tuple[bytes, bytes]], list[bytes]] | None = None
        self._ping_payload: bytes | None = None
        self._ping_timer: asyncio.TimerHandle | None = None
        self._close_timer: asyncio.TimerHandle | None = None
        self._fragment_timer: asyncio.TimerHandle | None = None
        self._failure: tuple[int, str] | None = None  # a protocol error waiting for the app (``_fail``)
        self._fail_timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        """Register the connection with the server (its shutdown closes every one it knows)."""
        self.transport = transport  # type: ignore[assignment]
        self.server_state.connections.add(self)  # type: ignore[arg-type]
        http = transport.get_protocol()  # uvicorn's HTTP protocol, handing over: it asked the socket already
        if hasattr(http, "server") and hasattr(http, "client") and hasattr(http, "scheme"):
            self._addresses = (http.server, http.client, "wss" if http.scheme == "https" else "ws")
        else:
            self._addresses = (get_local_addr(transport), get_remote_addr(transport),  # type: ignore[arg-type]
                               "wss" if is_ssl(transport) else "ws")  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is gone: tell the app (if it still listens) and drop every timer."""
        self.server_state.connections.discard(self)  # type: ignore[arg-type]
        self._cancel_timers()
        if not self.disconnected:
            self.disconnected = True
            self._put({"type": "websocket.disconnect", "code": 1006})  # no close frame: abnormal closure
        if self._writable is not None:
            self._writable.set()
        self.state = "closed"
        if exc is None:
            self.transport.close()

    def eof_received(self) -> None:
        """Half-close from the peer: the transport closes itself (see ``_close``)."""
        self._cut_off_later()

    def pause_writing(self) -> None:
        """The transport's write buffer is above its high-water mark: ``send`` waits, reading pauses."""
        if self._writable is None:
            self._writable = asyncio.Event()
        self._writable.clear()
        self._pause()  # no more pongs (or replies to pipelined requests) for a peer that does not read

    def resume_writing(self) -> None:
        """The write buffer drained: ``send`` goes on, and reading unless something else holds it."""
        if self._writable is not None:
            self._writable.set()
        if self._read_paused:
            self._resume()

    def data_received(self, data: bytes) -> None:
        """Bytes from the peer: the upgrade request first, then frames."""
        if self.disconnected:
            return
        if self._buffer:
            self._buffer += data
            buffer: bytes | bytearray = self._buffer
        else:
            buffer = data
        if self.state == "handshake":
            end = buffer.find(b"\r\n\r\n")
            if end < 0:  # never with uvicorn: both ways in hand over a whole request head
                self._keep(buffer, 0)
                return
            head = bytes(buffer[:end])
            self._keep(buffer, end + 4)
            self._handshake(head)
        elif self.state == "open":
            self._keep(buffer, self._parse(buffer))
        else:  # frames sent before the handshake finished wait for it, and nothing more is read
            self._keep(buffer, 0)
            self._pause()

    def _keep(self, buffer: bytes | bytearray, used: int) -> None:
        """Keep what is left of ``buffer`` past ``used`` bytes for the next ``data_received``."""
        if used >= len(buffer):
            self._buffer = bytearray()
        elif buffer is self._buffer:
            del self._buffer[:used]
        else:
            self._buffer = bytearray(memoryview(buffer)[used:])

    def shutdown(self) -> None:
        """uvicorn is exiting: close with 1012 (service restart), or 500 before the handshake."""
        self._cancel_timers()
        if self.state == "open" and not self.close_sent and not self.disconnected:
            self.close_sent = self.disconnected = True
            self._put({"type": "websocket.disconnect", "code": 1012})
            self.transport.write(close_frame(1012))
        elif self.state in ("handshake", "connecting"):
            self._reject(500, b"server shutting down")
        self._close()

    # The opening handshake

    def _handshake(self, head: bytes) -> None:
        request = read_upgrade(head)
        if isinstance(request, Refusal):
            self._reject(*request)
            return
        self._accept_key = request.accept_key
        self.scope = upgrade_scope(request, self.config, self._addresses, self.app_state)
        self.state = "connecting"
        self._put({"type": "websocket.connect"})
        task = self.loop.create_task(self._run_asgi())
        self.server_state.tasks.add(task)
        task.add_done_callback(self.server_state.tasks.discard)

    def _accept(self, message: dict[str, Any]) -> None:
        headers = [*self.server_state.default_headers, *message.get("headers", ())]
        self.transport.write(accept_response(self._accept_key, headers, message.get("subprotocol")))
        self.state = "open"
        interval = self.config.ws_ping_interval
        if interval:
            self._ping_timer = self.loop.call_later(interval, self._ping)
        self._resume()

    def _reject(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """An HTTP response instead of the handshake, then close (nothing to tell the app)."""
        self.state = "closed"
        self.close_sent = True
        self.transport.write(http_response(status, [*self.server_state.default_headers, *(headers or ())], body))
        self._close()

    # Frames from the peer

    def _parse(self, buffer: bytes | bytearray) -> int:
        """Handle every complete frame in ``buffer`` (until reading pauses); returns how many bytes they took."""
        pos, size = 0, len(buffer)
        while size - pos >= 2 and not self.disconnected and not self._read_paused:
            first, second = buffer[pos], buffer[pos + 1]
            length, start = second & 0x7F, pos + 2
            if length == 126:
                if size - pos < 4:
                    break
                length, start = int.from_bytes(buffer[start:start + 2], "big"), start + 2
            elif length == 127:
                if size - pos < 10:
                    break
                length, start = int.from_bytes(buffer[start:start + 8], "big"), start + 8
            opcode = first & 0x0F
            if not second & 0x80:
                self._fail(1002, "client frames must be masked")
            elif first & 0x70:
                self._fail(1002, "reserved bits set, and no extension was negotiated")
            elif opcode >= _CLOSE and (length > 125 or not first & 0x80):
                self._fail(1002, "control frames must be final and at most 125 bytes")
            elif length >> 63:
                self._fail(1002, "a 64-bit payload length must have its most significant bit clear")
            elif length + self._fragment_size > self.max_size:
                self._fail(1009, f"message larger than {self.max_size} bytes")
            if self.disconnected or self._failure is not None or size < start + 4 + length:
                break
            payload = apply_mask(buffer[start + 4:start + 4 + length], buffer[start:start + 4])
            pos = start + 4 + length
            self._frame_received(first & 0x80, opcode, payload)
        return pos

    def _frame_received(self, fin: int, opcode: int, payload: bytes) -> None:
        if opcode == _TEXT or opcode == _BINARY:
            if self._fragments is not None:
                self._fail(1002, "a new message began before the fragmented one ended")
            elif fin:
                self._message(opcode, payload)
                return  # queued for the app: reading pauses when it is behind (``_deliver``)
            else:
                self._fragment_opcode, self._fragments = opcode, bytearray()
                self._decoder = utf8_decoder() if opcode == _TEXT else None
                self._fragment_timer = self.loop.call_later(self._fragment_timeout, self._fragment_timed_out)
                self._fragment(self._fragments, payload, False)
        elif opcode == _CONT:
            if self._fragments is None:
                self._fail(1002, "continuation frame without a message to continue")
            else:
                self._fragment(self._fragments, payload, fin)
        elif opcode == _CLOSE:
            self._close_received(payload)
        elif opcode == _PING:
            if not self.close_sent:
                self.transport.write(frame(0x80 | _PONG, payload))
        elif opcode == _PONG:
            if self._ping_payload is not None and payload == self._ping_payload:
                self._ping_payload = None
                self._ping_timer.cancel()  # type: ignore[union-attr]
                self._ping_timer = self.loop.call_later(self.config.ws_ping_interval, self._ping)  # type: ignore[arg-type]
        else:
            self._fail(1002, f"unknown opcode {opcode}")
        self._count_frame()

    def _count_frame(self) -> None:
        """Count a frame that gave the app no message: past ``_FRAMES_PER_TURN`` of them, reading
        pauses until the loop's next turn, and the rest of the buffer waits for it.

        Frames that give the app nothing (fragments, pings, pongs) are otherwise bounded by nothing
        but the read size: a read of 256 KiB holds 40,000 empty ones (~80 ms), and each of the few
        dozen loop turns another connection's request takes waited for one (2 million two-byte
        fragments: /health answered after 2.8 s).
        """
        self._frames += 1
        if self._frames >= _FRAMES_PER_TURN:
            self._frames = 0
            self._pause()
            self.loop.call_soon(self._resume)

    def _fragment(self, parts: bytearray, payload: bytes, fin: int) -> None:
        """One part of a fragmented message (``parts``: the payload so far); a text part's UTF-8 is
        checked now, not at the end.

        The parts are joined as they come, so a message held costs its payload bytes however many
        fragments carry it: a list of parts cost ~60 bytes a fragment (2 million two-byte fragments:
        +140 MiB for 3.8 MiB of payload).
        """
        if self._decoder is not None:
            try:
                self._decoder.decode(payload, bool(fin))  # checked only: the text is decoded whole at the end
            except UnicodeDecodeError:
                self._fail(1007, "text message is not valid UTF-8")
                return
        parts += payload
        self._fragment_size = len(parts)
        if not fin:
            return
        self._fragments, self._decoder, self._fragment_size = None, None, 0
        if self._fragment_timer is not None:
            self._fragment_timer.cancel()
            self._fragment_timer = None
        if self._fragment_opcode == _TEXT:
            message: dict[str, Any] = {"type": "websocket.receive", "text": parts.decode()}
        else:
            message = {"type": "websocket.receive", "bytes": bytes(parts)}
        self._deliver(message, len(parts))

    def _fragment_timed_out(self) -> None:
        if self._app_behind():  # the rest may be in the unread socket: the peer is not late
            self._fragment_timer = self.loop.call_later(self._fragment_timeout, self._fragment_timed_out)
            return
        self._fragment_timer = None
        self._fail_now(1008, f"fragmented message not completed within {self._fragment_timeout:g} s")

    def _message(self, opcode: int, payload: bytes) -> None:
        if self.close_sent:
            return  # the app is past websocket.close: only the peer's close matters now
        if opcode == _TEXT:
            try:
                text = payload.decode()
            except UnicodeDecodeError:
                self._fail(1007, "text message is not valid UTF-8")
                return
            self._deliver({"type": "websocket.receive", "text": text}, len(payload))
        else:
            self._deliver({"type": "websocket.receive", "bytes": payload}, len(payload))

    def _deliver(self, event: dict[str, Any], size: int) -> None:
        """Queue a message for the app; reading pauses once the queue holds enough (by bytes or count)."""
        if self.close_sent:
            return
        self._put(event, size)
        if self._queued_bytes >= self._max_buffered or len(self._events) >= _MAX_QUEUED:
            self._pause()

    # Flow control: reading pauses while the handshake is pending, the write buffer is full or the
    # app is behind, and resumes (handling what was left unparsed) once none of these holds.

    def _pause(self) -> None:
        if not self._read_paused and not self.transport.is_closing():
            self._read_paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._read_paused:
            if (self._failure is not None or self.state != "open" or self._write_full()
                    or self._queued_bytes > self._max_buffered // 2 or len(self._events) > _MAX_QUEUED // 2):
                return
        self._unpause()

    def _unpause(self) -> None:
        """Read again, and handle the frames left unparsed when reading paused."""
        if self._read_paused:
            self._read_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()
        if self._buffer and self.state == "open" and not self.disconnected:
            self._keep(self._buffer, self._parse(self._buffer))

    def _write_full(self) -> bool:
        return self._writable is not None and not self._writable.is_set()

    def _app_behind(self) -> bool:
        """Reading is paused for the app only (the peer may well have answered in the unread bytes)."""
        return self._read_paused and self.state == "open" and not self._write_full()

    def _close_received(self, payload: bytes) -> None:
        if self.close_sent:  # the peer answered our close: the closing handshake is complete
            self.disconnected = True
            self._close()
            return
        code, reason = 1005, ""
        if len(payload) == 1:
            self._fail(1002, "close frame payload of one byte")
            return
        if payload:
            code = int.from_bytes(payload[:2], "big")
            try:
                reason = payload[2:].decode()
            except UnicodeDecodeError:
                self._fail(1007, "close reason is not valid UTF-8")
                return
            if code not in VALID_CLOSE and not 3000 <= code <= 4999:
                self._fail(1002, f"invalid close code {code}")
                return
        self.disconnected = self.close_sent = True
        self._put({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.transport.write(close_frame(code) if code != 1005 else frame(0x80 | _CLOSE, b""))
        self._close()

    def _fail(self, code: int, reason: str) -> None:
        """A frame broke the protocol: fail the connection, after the app has read what came before.

        Messages that arrived before the bad frame are the app's to answer first (what Autobahn
        calls strict: the echo of a valid message, then the close), so while some are still queued
        reading stops and the failure waits until the app has read them, ``_FAIL_DELAY`` at most.
        """
        if self.disconnected or self._failure is not None:
            return
        if not self._events or self.state != "open" or self.close_sent:
            self._fail_now(code, reason)
            return
        self._failure = (code, reason)
        self._pause()
        self._fail_timer = self.loop.call_later(_FAIL_DELAY, self._fail_now, code, reason)

    def _fail_now(self, code: int, reason: str) -> None:
        """Fail the connection (RFC 6455 section 7.1.7): send a close frame and stop reading frames.

        The TCP connection is half-closed rather than dropped: dropping it with unread bytes would
        reset it, and the peer could lose the close frame that says why. What the peer sends from
        now on is discarded until it closes, or for ``_CLOSE_TIMEOUT`` seconds at most.
        """
        self._failure = None
        if self._fail_timer is not None:
            self._fail_timer.cancel()
            self._fail_timer = None
        if self.disconnected:
            return
        self.disconnected = True
        self._put({"type": "websocket.disconnect", "code": code, "reason": reason})
        if self._read_paused:  # read (and discard) again: the peer's close or EOF ends it sooner
            self._read_paused = False
            self.transport.resume_reading()
        if not self.close_sent:
            self.close_sent = True
            self.transport.write(close_frame(code, reason))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if self._close_timer is None:
            self._close_timer = self.loop.call_later(_CLOSE_TIMEOUT, self.transport.abort)

    # Keep-alive

    def _ping(self) -> None:
        self._ping_timer = None
        if self.close_sent or self.disconnected:
            return
        interval: float = self.config.ws_ping_interval  # type: ignore[assignment]
        if self._app_behind():  # its pong could not be read: ask once the app has caught up
            self._ping_timer = self.loop.call_later(interval, self._ping)
            return
        self._ping_payload = random.getrandbits(32).to_bytes(4, "big")
        self.transport.write(frame(0x80 | _PING, self._ping_payload))
        timeout = self.config.ws_ping_timeout
        if timeout:
            self._ping_timer = self.loop.call_later(timeout, self._ping_timed_out)
        else:
            self._ping_timer = self.loop.call_later(interval, self._ping)

    def _ping_timed_out(self) -> None:
        if self._app_behind():  # the pong may be in the unread bytes: not the peer's fault
            self._ping_payload = None
            self._ping_timer = self.loop.call_later(self.config.ws_ping_interval, self._ping)  # type: ignore[arg-type]
            return
        self._ping_timer = None
        self._fail_now(1011, "keepalive ping timeout")

    def _cancel_timers(self) -> None:
        for timer in (self._ping_timer, self._close_timer, self._fragment_timer, self._fail_timer):
            if timer is not None:
                timer.cancel()
        self._ping_timer = self._close_timer = self._fragment_timer = self._fail_timer = None
        self._ping_payload = None  # a late pong has no deadline left to cancel

    # ASGI

    async def _run_asgi(self) -> None:
        try:
            result = await self.app(self.scope, self.receive, self.send)
        except ClientDisconnected:
            pass
        except BaseException:
            logger.exception("exception in the ASGI application")
            self._reject_if_connecting()
        else:
            if self.state in ("connecting", "responding"):
                logger.error("the ASGI application returned without completing the WebSocket handshake")
                self._reject_if_connecting()
            elif result is not None:
                logger.error("the ASGI application returned %r instead of None", result)
        if self._close_timer is None:
            self._close()

    def _reject_if_connecting(self) -> None:
        if self.state == "connecting" or self.state == "responding":
            self._reject(500, b"Internal Server Error")

    def _put(self, event: dict[str, Any], size: int = 0) -> None:
        self._events.append(event)
        self._sizes.append(size)
        self._queued_bytes += size
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self) -> dict[str, Any]:
        """The next ASGI event: ``websocket.connect``, then ``receive`` messages, then ``disconnect``."""
        events = self._events
        while not events:
            if self._failure is not None:  # the app has read what came before the bad frame
                self._fail_now(*self._failure)
                continue
            self._waiter = self.loop.create_future()
            await self._waiter
        event = events.popleft()
        self._queued_bytes -= self._sizes.popleft()
        if self._read_paused:
            self._resume()
        return event

    async def send(self, message: dict[str, Any]) -> None:
        """Carry out one ASGI event of the app: accept/refuse the handshake, send a message, close.

        Raises:
            ClientDisconnected: the peer is gone (an ``OSError``).
            RuntimeError: an event that is not allowed in the connection's state.
        """
        if self._writable is not None and not self._writable.is_set():
            await self._writable.wait()
        kind = message["type"]
        if self.disconnected:
            raise ClientDisconnected()
        state = self.state
        if state == "open":
            if self.close_sent:
                raise RuntimeError(f"unexpected ASGI message {kind!r} after sending websocket.close")
            if kind == "websocket.send":
                text = message.get("text")
                if text is not None:
                    self.transport.write(frame(0x80 | _TEXT, text.encode()))
                else:
                    self.transport.write(frame(0x80 | _BINARY, message["bytes"]))
            elif kind == "websocket.close":
                self._send_close(message.get("code", 1000), message.get("reason") or "")
            else:
                raise RuntimeError(f"expected 'websocket.send' or 'websocket.close', got {kind!r}")
        elif state == "connecting":
            if kind == "websocket.accept":
                self._accept(message)
            elif kind == "websocket.close":
                self._put({"type": "websocket.disconnect", "code": 1006})
                self._reject(403, b"")
            elif kind == "websocket.http.response.start":
                if not 100 <= message["status"] < 600:
                    raise RuntimeError(f"invalid HTTP status code {message['status']!r}")
                self.state = "responding"
                self._response = (message["status"], list(message.get("headers", ())), [])
            else:
                raise RuntimeError(f"expected 'websocket.accept', 'websocket.close' or "
                                   f"'websocket.http.response.start', got {kind!r}")
        elif state == "responding" and kind == "websocket.http.response.body":
            status, headers, body = self._response  # type: ignore[misc]
            body.append(message.get("body", b""))
            if not message.get("more_body", False):
                self._put({"type": "websocket.disconnect", "code": 1006})
                self._reject(status, b"".join(body), headers)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} in state {state!r}")

    def _send_close(self, code: int, reason: str) -> None:
        """Start the closing handshake; the socket drops on the peer's reply or after a timeout."""
        self.close_sent = True
        self._put({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.transport.write(close_frame(code, reason))
        self._unpause()  # the peer's close frame may be behind what the app never read
        self._close_timer = self.loop.call_later(_CLOSE_TIMEOUT, self.transport.abort)

    def _close(self) -> None:
        """Close the socket once what was written to it is flushed, within ``_CLOSE_TIMEOUT`` seconds."""
        self.transport.close()
        self._cut_off_later()

    def _cut_off_later(self) -> None:
        """A transport closes only once its write buffer is flushed, so a peer that never reads would
        hold the socket and the buffer forever: unless the buffer is empty, drop it all in
        ``_CLOSE_TIMEOUT`` seconds."""
        if self.transport.get_write_buffer_size():
            self.loop.call_later(_CLOSE_TIMEOUT, self.transport.abort)

