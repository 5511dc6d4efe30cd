"""Requests as an attacker sends them: heads too large (431), too slow (closed) or malformed (400),
bodies (413, never read), pipelines too deep (429).

The upgrade fast path (``envserver._http.UpgradeFastPath``) must not take anything uvicorn's own
parser would refuse or treat as plain HTTP, and the bearer check reads the header as RFC 9110 does.
"""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.envserver.servers import http_get, make_server, wait_until

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def guarded():
    """A server with a token, a 4 KiB head limit and a 1 s head timeout."""
    srv = make_server(token=TOKEN, max_head_bytes=4096, head_timeout=1.0)
    yield srv
    srv.stop()


def exchange(srv, raw: bytes, chunk: int = 0) -> bytes:
    """Send ``raw`` (in pieces of ``chunk`` bytes if set) and read until the server closes or 5 s pass."""
    sock = socket.create_connection(("127.0.0.1", srv.server.bound_port), timeout=5)
    try:
        try:
            for start in range(0, len(raw), chunk or len(raw)):
                sock.sendall(raw[start:start + (chunk or len(raw))])
        except BrokenPipeError:  # refused before the whole head was sent: the answer is there to read
            pass
        data = b""
        while True:
            try:
                more = sock.recv(65536)
            except (TimeoutError, ConnectionError):
                return data
            if not more:
                return data
            data += more
            if data.startswith(b"HTTP/1.1 101"):  # a WebSocket: the status is all we look at
                return data
    finally:
        sock.close()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response else -1


def upgrade(*fields: str) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    lines = ["GET /v1/ws/counter?v=1 HTTP/1.1", "Host: x", "Upgrade: websocket", "Connection: Upgrade",
             f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13", *fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def plain(target: str, *fields: str) -> bytes:
    return ("\r\n".join([f"GET {target} HTTP/1.1", "Host: x", *fields]) + "\r\n\r\n").encode()


@pytest.mark.parametrize("chunk", [0, 1000], ids=["one-read", "many-reads"])
@pytest.mark.parametrize("make", [upgrade, lambda *f: plain("/health", *f)], ids=["upgrade", "plain"])
def test_a_head_above_the_limit_gets_431_and_is_closed(guarded, make, chunk):
    response = exchange(guarded, make(f"Authorization: Bearer {TOKEN}", "X-Pad: " + "a" * 8000), chunk)
    assert status_of(response) == 431
    assert b"max_head_bytes" in response


def test_a_head_just_under_the_limit_is_served(guarded):
    response = exchange(guarded, plain("/health", f"Authorization: Bearer {TOKEN}", "X-Pad: " + "a" * 3500))
    assert status_of(response) == 200


def test_slowloris_heads_are_closed_after_the_head_timeout_while_others_are_served(guarded):
    socks = []
    for _ in range(40):
        sock = socket.create_connection(("127.0.0.1", guarded.server.bound_port), timeout=10)
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # and never the rest
        socks.append(sock)
    idle = socket.create_connection(("127.0.0.1", guarded.server.bound_port), timeout=10)  # sends nothing
    try:
        assert status_of(exchange(guarded, plain("/health", f"Authorization: Bearer {TOKEN}"))) == 200
        started = time.monotonic()
        for sock in [*socks, idle]:
            sock.sendall(b"X")  # one more byte each: still no complete head
            assert sock.recv(100) == b""  # closed by the server, with no response
        assert time.monotonic() - started < 8  # 1 s head timeout, generous on a loaded machine
    finally:
        for sock in [*socks, idle]:
            sock.close()


def test_a_keep_alive_connection_gets_the_head_timeout_for_its_next_request_too(guarded):
    sock = socket.create_connection(("127.0.0.1", guarded.server.bound_port), timeout=10)
    try:
        sock.sendall(plain("/health", f"Authorization: Bearer {TOKEN}"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next head, never finished
        started = time.monotonic()
        assert sock.recv(100) == b""
        assert time.monotonic() - started < 8
    finally:
        sock.close()


@pytest.mark.parametrize(("raw", "status"), [
    # Plain HTTP whose bytes merely mention websocket is plain HTTP (the fast path once took it: 400).
    (plain("/health?note=websocket", f"Authorization: Bearer {TOKEN}"), 200),
    (plain("/health", f"Authorization: Bearer {TOKEN}", "X-Note: websocket"), 200),
    # The auth scheme is case-insensitive; the token is not.
    (plain("/health", f"Authorization: bearer {TOKEN}"), 200),
    (plain("/health", f"Authorization: BEARER {TOKEN}"), 200),
    (upgrade(f"Authorization: bearer {TOKEN}"), 101),
    (plain("/health", f"Authorization: Bearer {TOKEN.upper()}"), 401),
    (plain("/health", f"Authorization: Basic {TOKEN}"), 401),
    (plain("/health", f"Authorization: Bearer{TOKEN}"), 401),
    (upgrade(f"Authorization: Bearer {TOKEN}", "Authorization: Bearer wrong"), 401),
    (plain("/health", f"Authorization: Bearer {TOKEN}", "Authorization: Bearer wrong"), 401),
    # Header syntax as strict as uvicorn's parser, on both paths: no space before the colon, no folding.
    (plain("/health", f"Authorization : Bearer {TOKEN}"), 400),
    (upgrade(f"Authorization : Bearer {TOKEN}"), 400),
    (upgrade(f"Authorization: Bearer {TOKEN}", " folded"), 400),
    (upgrade(f"Authorization: Bearer {TOKEN}", "Bad Name: x"), 400),
], ids=lambda value: value if isinstance(value, int) else value.split(b"\r\n")[0][:40].decode())
def test_heads_are_parsed_as_strictly_as_uvicorn_does(guarded, raw, status):
    assert status_of(exchange(guarded, raw)) == status


def test_the_same_heads_split_over_reads_get_the_same_answers(guarded):
    for raw, status in [(upgrade(f"Authorization: bearer {TOKEN}"), 101),
                        (upgrade(f"Authorization : Bearer {TOKEN}"), 400),
                        (plain("/health?note=websocket", f"Authorization: Bearer {TOKEN}"), 200)]:
        assert status_of(exchange(guarded, raw, chunk=7)) == status


def test_routes_still_answer_with_the_token(guarded):
    assert http_get(guarded.url + "/health", token=TOKEN)[0] == 200


def open_connections(srv) -> int:
    """Connections the server holds (HTTP and WebSocket), read from its state for assertions."""
    return len(srv.server.server_state.connections)


@contextlib.contextmanager
def trickling(socks: list[socket.socket], every: float = 0.05) -> Iterator[None]:
    """While inside, send one more byte on each of ``socks`` every ``every`` seconds (a slow body)."""
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(every):
            for sock in socks:
                with contextlib.suppress(OSError):  # the server dropped it: that is what the test waits for
                    sock.send(b"a")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def read_answer(sock: socket.socket) -> bytes:
    """What the server sends until it half-closes (or drops) the connection."""
    data = b""
    with contextlib.suppress(ConnectionError):
        while more := sock.recv(65536):
            data += more
    return data


@pytest.mark.parametrize("head", [
    "POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n",
    "GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n",
    "GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
    # An empty chunked body, then a trailer field that never ends: once parsed as headers past every limit.
    "POST /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Trailer: ",
], ids=["post-length", "get-length", "get-chunked", "chunked-trailer"])
def test_a_request_with_a_body_is_answered_413_unread_and_dropped_however_slow_the_body(head):
    # Before: the head deadline ended with the head, so 50 of 50 such connections fed a byte a second
    # were still open a minute later (answered 405, the body read and discarded as it came).
    srv = make_server(head_timeout=1.0)
    socks = [socket.create_connection(("127.0.0.1", srv.server.bound_port), timeout=30) for _ in range(50)]
    try:
        for sock in socks:
            sock.sendall(head.encode())
        with trickling(socks):
            answers = [read_answer(sock) for sock in socks]  # sent as soon as the head is complete
            assert wait_until(lambda: open_connections(srv) == 0, timeout=30)
        assert all(status_of(answer) == 413 and b"no request body" in answer for answer in answers)
    finally:
        for sock in socks:
            sock.close()
        srv.stop()


def test_a_content_length_of_zero_is_no_body(guarded):
    raw = plain("/health", f"Authorization: Bearer {TOKEN}", "Content-Length: 0", "Connection: close")
    assert status_of(exchange(guarded, raw)) == 200


def pipelined(count: int) -> bytes:
    return plain("/health", f"Authorization: Bearer {TOKEN}") * count


def test_a_few_pipelined_requests_are_all_answered_on_an_open_connection(guarded):
    sock = socket.create_connection(("127.0.0.1", guarded.server.bound_port), timeout=10)
    try:
        sock.sendall(pipelined(16))
        data = b""
        while data.count(b"HTTP/1.1 200 OK") < 16:
            data += sock.recv(65536)
        sock.sendall(plain("/health", f"Authorization: Bearer {TOKEN}"))  # and the connection still serves
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()


def test_past_16_pipelined_requests_the_next_is_answered_429_and_the_rest_never_read():
    # Before: every answer written resumed reading, so a peer that pipelined GETs and read nothing
    # had the server parse and hold all of them (10 connections: +3.2 GiB in 30 s).
    srv = make_server(head_timeout=1.0)
    sock = socket.create_connection(("127.0.0.1", srv.server.bound_port), timeout=30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        with contextlib.suppress(OSError):  # the server stops reading, then drops the connection
            sock.sendall(plain("/health") * 100_000)
        answers = read_answer(sock)
        assert wait_until(lambda: open_connections(srv) == 0, timeout=30)
    finally:
        sock.close()
        srv.stop()
    served = answers.count(b"HTTP/1.1 200 OK")
    assert 17 <= served < 1000  # the running one and the 16 behind it, at least (one read may hold more)
    assert answers.count(b"HTTP/1.1 429") == 1 and answers.rstrip().endswith(b"wait for the answers")
