"""Request heads as an attacker sends them: too large (431), too slow (closed), malformed (400).

The upgrade fast path (``envserver._http.UpgradeFastPath``) must not take anything uvicorn's own
parser would refuse or treat as plain HTTP, and the bearer check reads the header as RFC 9110 does.
"""

from __future__ import annotations

import base64
import os
import socket
import time

import pytest

from tests.envserver.servers import http_get, make_server

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
