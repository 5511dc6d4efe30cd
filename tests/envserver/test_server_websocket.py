"""The server's own WebSocket protocol (``envserver._websocket``) at the RFC 6455 level.

Some cases speak raw frames over a socket (``RawSocket``) to send what a well-behaved client
library never would: unmasked frames, bad UTF-8, unanswered pings.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import socket
import time
from typing import Any

import pytest
import websockets

from toolgym_fixtures import health, make_server, request, ws_url


class RawSocket:
    """A blocking WebSocket client that sends exactly the bytes it is told to."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, split: bool = False) -> None:
        host, port = url.split("//")[1].split("/")[0].split(":")
        self.target = "/" + url.split("//")[1].split("/", 1)[1]
        self.key = base64.b64encode(os.urandom(16)).decode()
        fields = {"Host": f"{host}:{port}", "Upgrade": "websocket", "Connection": "Upgrade",
                  "Sec-WebSocket-Key": self.key, "Sec-WebSocket-Version": "13", **(headers or {})}
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        request = (f"GET {self.target} HTTP/1.1\r\n".encode()
                   + b"".join(f"{k}: {v}\r\n".encode() for k, v in fields.items()) + b"\r\n")
        if split:  # in two TCP segments: the server's fast path does not apply, uvicorn's parser does
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.sendall(request[:20])
            time.sleep(0.05)
            request = request[20:]
        self.sock.sendall(request)
        self.buffer = b""

    def response_head(self) -> tuple[int, dict[str, str]]:
        """Status and headers (lower-case names) of the handshake response."""
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}

    def send_frame(self, opcode: int, payload: bytes, fin: bool = True, masked: bool = True) -> None:
        """One frame, masked with a random key unless ``masked`` is false."""
        head = bytes((0x80 * fin | opcode,))
        n = len(payload)
        flag = 0x80 if masked else 0
        if n < 126:
            head += bytes((flag | n,))
        elif n < 1 << 16:
            head += bytes((flag | 126,)) + n.to_bytes(2, "big")
        else:
            head += bytes((flag | 127,)) + n.to_bytes(8, "big")
        if masked:
            mask = os.urandom(4)
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            head += mask
        self.sock.sendall(head + payload)

    def recv_frame(self) -> tuple[int, bytes]:
        """(opcode, payload) of the next server frame; (-1, b"") once the server closed the TCP."""
        try:
            while len(self.buffer) < 2:
                self._read()
            n, start = self.buffer[1] & 0x7F, 2
            if n == 126:
                n, start = int.from_bytes(self._need(4)[2:4], "big"), 4
            elif n == 127:
                n, start = int.from_bytes(self._need(10)[2:10], "big"), 10
            frame = self._need(start + n)
        except ConnectionError:
            return -1, b""
        self.buffer = self.buffer[start + n:]
        return frame[0] & 0x0F, frame[start:start + n]

    def close_code(self) -> int:
        """Skip frames up to the server's close frame; its status code."""
        while True:
            opcode, payload = self.recv_frame()
            if opcode in (0x8, -1):
                return int.from_bytes(payload[:2], "big") if payload else -1

    def _need(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._read()
        return self.buffer

    def _read(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("closed")
        self.buffer += data

    def close(self) -> None:
        """Drop the TCP connection."""
        self.sock.close()


def open_session(srv: Any, split: bool = False) -> RawSocket:
    """A raw WebSocket with a fresh counter session (hello read)."""
    raw = RawSocket(ws_url(srv, "counter"), split=split)
    status, headers = raw.response_head()
    assert status == 101
    accept = base64.b64encode(hashlib.sha1((raw.key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
    assert headers["sec-websocket-accept"] == accept.decode()
    assert "sec-websocket-extensions" not in headers  # never negotiates permessage-deflate
    assert json.loads(raw.recv_frame()[1])["op"] == "hello"
    return raw


def call(raw: RawSocket, rid: int, op: str, **fields: Any) -> dict[str, Any]:
    raw.send_frame(0x1, json.dumps({"id": rid, "op": op, **fields}).encode())
    opcode, payload = raw.recv_frame()
    assert opcode == 0x1
    return json.loads(payload)


@pytest.fixture(scope="module")
def small():
    """A server with a 4 KiB frame limit (16 KiB hard limit) and fast keep-alive pings."""
    srv = make_server(max_frame_bytes=4096, resume_grace=0.5)
    srv.server.config.ws_ping_interval = 0.3  # read per connection: only the ones opened from now
    srv.server.config.ws_ping_timeout = 0.5
    yield srv
    srv.stop()


@pytest.mark.parametrize(("headers", "status"), [
    ({"Sec-WebSocket-Version": "8"}, 426),
    ({"Sec-WebSocket-Key": "too-short"}, 400),
    ({"Connection": "keep-alive"}, 400),
])
def test_bad_handshakes_get_an_http_error(server, headers, status):
    raw = RawSocket(ws_url(server, "counter"), headers)
    code, fields = raw.response_head()
    raw.close()
    assert code == status
    if status == 426:
        assert fields["sec-websocket-version"] == "13"


def test_a_websocket_to_another_path_is_refused_with_403(server):
    async def scenario():
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(server.url.replace("http://", "ws://") + "/nope")
        return refused.value.response.status_code

    assert asyncio.run(scenario()) == 403


@pytest.mark.parametrize("split", [False, True], ids=["fast-path", "uvicorn-parser"])
def test_fragmented_masked_message_and_ping_are_answered(small, split):
    raw = open_session(small, split)
    frame = json.dumps({"id": 1, "op": "call", "tool": "increment", "args": {"step": 2}}).encode()
    raw.send_frame(0x1, frame[:10], fin=False)
    raw.send_frame(0x9, b"are you there")  # a control frame between the fragments
    raw.send_frame(0x0, frame[10:20], fin=False)
    raw.send_frame(0x0, frame[20:])
    assert raw.recv_frame() == (0xA, b"are you there")
    assert json.loads(raw.recv_frame()[1]) == {"id": 1, "ok": True, "result": "2"}
    assert call(raw, 2, "close")["ok"] is True
    assert raw.close_code() == 4000
    raw.close()


@pytest.mark.parametrize(("opcode", "payload", "masked", "code"), [
    (0x1, b'{"id": 1, "op": "ping"}', False, 1002),  # client frames must be masked
    (0x1, b"\xff\xfe", True, 1007),  # not UTF-8
    (0x0, b"orphan", True, 1002),  # continuation without a message
    (0x3, b"", True, 1002),  # reserved opcode
    (0x8, b"\x03\xed", True, 1002),  # close code 1005 may not be sent
    (0x1, b"x" * (4 * 4096 + 1), True, 1009),  # above the hard limit: closed before it is read
])
def test_protocol_violations_close_the_connection_with_the_rfc_code(small, opcode, payload, masked, code):
    raw = open_session(small)
    raw.send_frame(opcode, payload, masked=masked)
    assert raw.close_code() == code
    raw.close()


def test_close_handshake_from_the_client_is_echoed(small):
    raw = open_session(small)
    raw.send_frame(0x8, (1000).to_bytes(2, "big") + b"bye")
    assert raw.recv_frame() == (0x8, (1000).to_bytes(2, "big"))
    assert raw.recv_frame() == (-1, b"")
    raw.close()


def test_keepalive_pings_and_a_silent_peer_is_dropped(small):
    raw = open_session(small)
    opcode, payload = raw.recv_frame()
    assert opcode == 0x9 and len(payload) == 4
    assert raw.close_code() == 1011  # never answered: dropped after ws_ping_timeout

    async def answering():  # websockets answers pings itself: the session outlives several intervals
        async with websockets.connect(ws_url(small, "counter")) as ws:
            await ws.recv()
            await asyncio.sleep(1.5)
            return await request(ws, 1, "close")

    assert asyncio.run(answering())["ok"] is True
    raw.close()
    assert health(small)["sessions"] <= 1  # the dropped one awaits resume for resume_grace
