"""Peers that stop reading: the server drops them instead of holding their answers forever.

A transport closes only once its write buffer is flushed, so before, a peer that never read a large
answer held its connection and the answer for good: 20 GET /v1/envs of 12 MB each, +241 MiB, all
20 connections still open 30 s later; 10 WebSocket sessions whose replies were never read, +139 MiB,
still open 80 s later (past the keep-alive ping and the close timeout). A peer that reads, however
slowly, keeps its connection.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from envserver import EnvSpec, ServerConfig, ServerThread, _websocket
from tests.envserver.servers import make_server, wait_until
from tests.envserver.wire import RawSocket, frame_bytes

ANSWER_BYTES = 10 << 20  # larger than the kernel's socket buffers (4 MiB at most here)


class BigDescriptionEnv:
    """An environment whose description (``GET /v1/envs``) is about 10 MB."""

    def reset(self, **kwargs: object) -> str:
        """Start an episode."""
        return "ready"

    def echo(self, text: str) -> str:
        """Echo text.

        Args:
            text: What to echo.
        """
        return text


BigDescriptionEnv.echo.__doc__ = "Echo text. " + "lorem ipsum " * (ANSWER_BYTES // 12) + """

        Args:
            text: What to echo.
        """


@pytest.fixture(scope="module")
def big():
    """A server whose /v1/envs answer is about 10 MB, with a 1 s head timeout."""
    specs = {"big": EnvSpec.from_factory("big", BigDescriptionEnv)}
    with ServerThread(specs, ServerConfig(port=0, head_timeout=1.0, drain_timeout=0.2)) as srv:
        yield srv


def open_connections(srv: ServerThread) -> int:
    """Connections the server holds (HTTP and WebSocket), read from its state for assertions."""
    return len(srv.server.server_state.connections)


def reluctant_socket(srv: ServerThread) -> socket.socket:
    """A connection with a small receive buffer, so the server's answers back up on its side."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", srv.server.bound_port))
    return sock


@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "connection-close"])
def test_a_peer_that_never_reads_a_large_answer_is_dropped(big, close):
    socks = [reluctant_socket(big) for _ in range(5)]
    try:
        for sock in socks:
            sock.sendall(b"GET /v1/envs HTTP/1.1\r\nHost: x\r\n" + b"Connection: close\r\n" * close + b"\r\n")
        assert wait_until(lambda: open_connections(big) == 5, timeout=30)
        assert wait_until(lambda: open_connections(big) == 0, timeout=30)  # head_timeout is 1 s
    finally:
        for sock in socks:
            sock.close()


def test_a_peer_that_reads_a_large_answer_slowly_gets_all_of_it(big):
    sock = reluctant_socket(big)  # 4 KiB a read: the answer takes ~2,500 reads
    try:
        sock.sendall(b"GET /v1/envs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = bytearray()
        while more := sock.recv(1 << 20):
            data += more
            time.sleep(0.002)  # the pace of a slow link: 5 s or more in all, five head timeouts
    finally:
        sock.close()
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and len(body) > ANSWER_BYTES
    assert "big" in json.loads(body)["environments"]


def test_a_websocket_peer_that_never_reads_its_replies_is_dropped(monkeypatch):
    monkeypatch.setattr(_websocket, "_CLOSE_TIMEOUT", 1.0)  # read when a close starts
    srv = make_server()
    srv.server.config.ws_ping_interval = 0.3  # read per connection: only the ones opened from now
    srv.server.config.ws_ping_timeout = 0.5
    raws = []
    try:
        for _ in range(3):
            raw = RawSocket(srv.url.replace("http://", "ws://") + "/v1/ws/probe?v=1")
            raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            request = {"op": "call", "tool": "echo", "args": {"text": "y" * 100_000, "times": 10}}
            for rid in range(1, 21):  # 20 replies of 1 MB, never read
                raw.sock.sendall(frame_bytes(0x1, json.dumps({"id": rid, **request}).encode()))
            raws.append(raw)
        assert wait_until(lambda: open_connections(srv) == 3, timeout=30)
        assert wait_until(lambda: open_connections(srv) == 0, timeout=30)  # a ping unanswered, then 1 s
    finally:
        for raw in raws:
            raw.close()
        srv.stop()
