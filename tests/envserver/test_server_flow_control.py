"""What one connection can make the server hold, in bytes: pipelined frames, unread pongs, fragments.

Reading from a socket pauses by bytes (``max_buffered_bytes``) and while its write buffer is full;
fragmented messages have a deadline and their UTF-8 is checked as each fragment arrives. Several
cases look inside the server's protocol object of the connection (read-only, for the assertion):
kernel socket buffers absorb megabytes, so what the client managed to send says little.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import pytest

from envserver._websocket import WebSocketProtocol
from tests.envserver.servers import health, make_server, wait_until, ws_url
from tests.envserver.wire import RawSocket, call, frame_bytes, open_session

MAX_FRAME = 4096
MAX_BUFFERED = 16384
READ_CHUNK = 256 << 10  # the most one socket read hands the protocol (uvloop); left unparsed when paused


@pytest.fixture(scope="module")
def tight():
    """Small frame and buffer limits, a short fragment deadline, no keep-alive pings."""
    srv = make_server(max_frame_bytes=MAX_FRAME, max_buffered_bytes=MAX_BUFFERED, fragment_timeout=0.5,
                      call_timeout=20.0, max_sessions=1, max_waiting=4, queue_timeout=20.0, resume_grace=0.5)
    srv.server.config.ws_ping_interval = None  # read per connection: only the ones opened from now
    yield srv
    srv.stop()


def protocol_of(srv: Any, raw: RawSocket) -> WebSocketProtocol:
    """The server's protocol object for ``raw``'s connection."""
    local = raw.sock.getsockname()
    for _ in range(1000):
        try:
            connections = list(srv.server.server_state.connections)
        except RuntimeError:  # the server's loop changed the set meanwhile
            continue
        for connection in connections:
            if isinstance(connection, WebSocketProtocol) and connection.transport.get_extra_info("peername") == local:
                return connection
        time.sleep(0.01)
    raise AssertionError("no server-side connection for this socket")


class Pusher:
    """Sends ``data`` from a thread for as long as the server reads it; ``sent`` counts the bytes."""

    def __init__(self, sock: socket.socket, data: bytes) -> None:
        self.sent = 0
        self._thread = threading.Thread(target=self._push, args=(sock, data), daemon=True)
        self._thread.start()

    def _push(self, sock: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        try:
            while self.sent < len(data):
                self.sent += sock.send(view[self.sent:self.sent + 65536])
        except OSError:  # the test closed the socket
            pass

    def wait_stalled(self, settle: float = 0.5, timeout: float = 30.0) -> int:
        """Wait until nothing more goes out for ``settle`` seconds (the server stopped reading, or all sent)."""
        deadline = time.monotonic() + timeout
        last = -1
        while self.sent != last and time.monotonic() < deadline:
            last = self.sent
            time.sleep(settle)
        return self.sent


def pings(first_id: int, count: int, size: int) -> bytes:
    """``count`` pipelined ``ping`` requests of about ``size`` bytes each."""
    return b"".join(frame_bytes(0x1, json.dumps({"id": rid, "op": "ping", "pad": "x" * (size - 40)}).encode())
                    for rid in range(first_id, first_id + count))


def test_frames_pipelined_behind_a_running_call_are_held_by_bytes_then_all_answered(tight):
    raw = open_session(tight, env="probe")
    try:
        raw.send_frame(0x1, json.dumps({"id": 1, "op": "call", "tool": "nap", "args": {"seconds": 4}}).encode())
        count = 1500  # ~6 MB behind the nap
        pusher = Pusher(raw.sock, pings(2, count, MAX_FRAME - 100))
        pusher.wait_stalled()
        server_side = protocol_of(tight, raw)
        queued, buffered = server_side._queued_bytes, len(server_side._buffer)
        paused = server_side._read_paused
        # Before: 64 queued messages whatever their size (~256 KB here; 64 x 4 MiB with default limits).
        assert queued <= MAX_BUFFERED + MAX_FRAME
        assert buffered <= READ_CHUNK + 4 * MAX_FRAME
        assert paused or pusher.sent == len(pings(2, count, MAX_FRAME - 100))
        replies = [json.loads(raw.recv_frame()[1]) for _ in range(count + 1)]
        assert [r["id"] for r in replies] == list(range(1, count + 2))
        assert replies[0]["result"] == "rested" and all(r["result"] == "pong" for r in replies[1:])
        assert call(raw, count + 2, "close")["ok"] is True
    finally:
        raw.close()


def test_a_connection_waiting_for_a_session_slot_is_held_by_bytes(tight):
    holder = open_session(tight)
    waiting = RawSocket(ws_url(tight, "counter"))
    try:
        assert waiting.response_head()[0] == 101  # accepted; no hello while the only slot is taken
        pusher = Pusher(waiting.sock, pings(1, 1500, MAX_FRAME - 100))
        pusher.wait_stalled()
        server_side = protocol_of(tight, waiting)
        assert server_side._queued_bytes <= MAX_BUFFERED + MAX_FRAME
        assert len(server_side._buffer) <= READ_CHUNK + 4 * MAX_FRAME
        assert health(tight)["waiting"] == 1
    finally:
        waiting.close()
        assert call(holder, 1, "close")["ok"] is True
        holder.close()
    assert wait_until(lambda: health(tight)["sessions"] == 0 and health(tight)["waiting"] == 0, timeout=25)


def test_pings_whose_pongs_are_never_read_stop_being_read(tight):
    raw = open_session(tight)
    try:
        ping = frame_bytes(0x9, b"p" * 125)
        pusher = Pusher(raw.sock, ping * 120_000)  # ~16 MB of pings, ~15 MB of pongs the client never reads
        pusher.wait_stalled()
        server_side = protocol_of(tight, raw)
        # Before: the pongs piled up in the transport's write buffer (+83 MiB seen with more pings).
        assert server_side.transport.get_write_buffer_size() <= (64 << 10) + READ_CHUNK
        assert server_side._read_paused
        assert pusher.sent < len(ping) * 120_000
    finally:
        raw.close()
    assert wait_until(lambda: health(tight)["sessions"] == 0, timeout=25)  # dropped: resumable, then expired


def test_an_unfinished_fragmented_message_is_closed_after_the_fragment_timeout(tight):
    raw = open_session(tight)
    try:
        raw.send_frame(0x1, b'{"id": 1, "op"', fin=False)  # and never the rest
        started = time.monotonic()
        assert raw.close_code() == 1008
        assert time.monotonic() - started < 10  # 0.5 s deadline; before, it waited for the idle timeout
    finally:
        raw.close()


def test_invalid_utf8_in_a_first_fragment_fails_at_once(tight):
    raw = open_session(tight)
    try:
        raw.send_frame(0x1, b'{"id": 1, "op": "\xff', fin=False)  # the rest is never sent
        assert raw.close_code() == 1007
    finally:
        raw.close()


def test_a_character_split_across_fragments_is_fine(tight):
    raw = open_session(tight)
    try:
        frame = json.dumps({"id": 1, "op": "call", "tool": "increment", "args": {"step": 1}, "note": "κ"},
                           ensure_ascii=False).encode()
        cut = frame.index("κ".encode()) + 1  # between the two bytes of the character
        raw.send_frame(0x1, frame[:cut], fin=False)
        raw.send_frame(0x0, frame[cut:])
        assert json.loads(raw.recv_frame()[1]) == {"id": 1, "ok": True, "result": "1"}
        assert call(raw, 2, "close")["ok"] is True
    finally:
        raw.close()


def test_keepalive_waits_while_reading_is_paused_for_a_slow_call():
    srv = make_server(max_frame_bytes=MAX_FRAME, max_buffered_bytes=MAX_BUFFERED, call_timeout=20.0)
    srv.server.config.ws_ping_interval = 0.3
    srv.server.config.ws_ping_timeout = 0.5
    raw = open_session(srv, env="probe")  # a client that never answers pings
    try:
        raw.send_frame(0x1, json.dumps({"id": 1, "op": "call", "tool": "nap", "args": {"seconds": 2}}).encode())
        raw.sock.sendall(pings(2, 20, 2048))  # 40 KB queued behind the nap: reading pauses
        frames = []
        while len(frames) < 21:
            opcode, payload = raw.recv_frame()
            assert opcode in (0x1, 0x9), (opcode, payload)  # never a close (1011) before the replies
            if opcode == 0x1:
                frames.append(json.loads(payload)["id"])
        assert frames == list(range(1, 22))
        assert raw.close_code() == 1011  # and afterwards, unanswered pings do end it
    finally:
        raw.close()
        srv.stop()
