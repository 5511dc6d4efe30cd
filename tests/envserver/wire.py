"""A raw WebSocket client for tests that send what a well-behaved client library never would."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import time
from typing import Any

from tests.envserver.servers import ws_url

__all__ = ["RawSocket", "call", "frame_bytes", "open_session"]


def frame_bytes(opcode: int, payload: bytes, fin: bool = True, masked: bool = True, rsv: int = 0) -> bytes:
    """One client frame, masked with a random key unless ``masked`` is false."""
    head = bytes((0x80 * fin | rsv << 4 | opcode,))
    n = len(payload)
    flag = 0x80 if masked else 0
    if n < 126:
        head += bytes((flag | n,))
    elif n < 1 << 16:
        head += bytes((flag | 126,)) + n.to_bytes(2, "big")
    else:
        head += bytes((flag | 127,)) + n.to_bytes(8, "big")
    if not masked:
        return head + payload
    mask = os.urandom(4)
    key = (mask * (n // 4 + 1))[:n]
    return head + mask + (int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")).to_bytes(n, "little")


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
        self.sock.sendall(frame_bytes(opcode, payload, fin, masked))

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
        """Drop the TCP connection (a ``send`` blocked on another thread returns at once)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more
            pass
        self.sock.close()


def open_session(srv: Any, split: bool = False, env: str = "counter") -> RawSocket:
    """A raw WebSocket with a fresh session of ``env`` (hello read)."""
    raw = RawSocket(ws_url(srv, env), split=split)
    status, headers = raw.response_head()
    assert status == 101
    accept = base64.b64encode(hashlib.sha1((raw.key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
    assert headers["sec-websocket-accept"] == accept.decode()
    assert "sec-websocket-extensions" not in headers  # never negotiates permessage-deflate
    assert json.loads(raw.recv_frame()[1])["op"] == "hello"
    return raw


def call(raw: RawSocket, rid: int, op: str, **fields: Any) -> dict[str, Any]:
    """Send one request as a text frame and return the decoded reply."""
    raw.send_frame(0x1, json.dumps({"id": rid, "op": op, **fields}).encode())
    opcode, payload = raw.recv_frame()
    assert opcode == 0x1
    return json.loads(payload)
