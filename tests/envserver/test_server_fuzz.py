"""Property-based fuzzing (hypothesis) of the frame parser and the JSON request layer, on a real server.

Properties, for every generated input:

* frames: whatever complete frames a peer sends (any opcode, flags, masking, lengths, payloads,
  fragments), followed by a close frame, the server answers with frames and ends with a close
  frame of its own: it never drops a connection without saying why;
* raw bytes: any bytes after the handshake, then the peer's EOF: the server ends the connection
  within seconds, never hanging on it;
* requests: every JSON (or not JSON) text frame gets exactly one reply, in order, with the
  request's id (``null`` when it has none) and, on failure, a documented error code; the
  connection stays open;
* and after every example a bystander session on the same server still answers.

Bounded for CI (``derandomize``: the same examples every run, about 20 s in all).
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envserver._wire import VALID_CLOSE
from sdk.protocol import ErrorCode
from tests.envserver.servers import health, make_server, wait_until
from tests.envserver.wire import RawSocket, call, frame_bytes, open_session

MAX_FRAME = 4096
CODES = {code.value for code in ErrorCode}
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def target():
    """A server with small limits, no keep-alive pings, and a bystander session held open throughout."""
    srv = make_server(max_frame_bytes=MAX_FRAME, fragment_timeout=2.0, resume_grace=0.3)
    srv.server.config.ws_ping_interval = None
    bystander = open_session(srv)
    yield srv, bystander
    bystander.close()
    srv.stop()


class Bystander:
    """Counts the bystander's requests so each one gets a fresh id."""

    rid = 0

    @classmethod
    def still_served(cls, raw: RawSocket) -> bool:
        cls.rid += 1
        return call(raw, cls.rid, "ping") == {"id": cls.rid, "ok": True, "result": "pong"}


def read_until_closed(raw: RawSocket, timeout: float = 10.0) -> list[tuple[int, bytes]]:
    """Every frame the server sends until it closes the TCP connection."""
    raw.sock.settimeout(timeout)
    frames = []
    while True:
        opcode, payload = raw.recv_frame()
        if opcode == -1:
            return frames
        frames.append((opcode, payload))


# Frames: opcodes valid and reserved, FIN and RSV bits, masked or not, payloads of every shape.
OPCODES = st.sampled_from([0x0, 0x1, 0x1, 0x1, 0x2, 0x8, 0x9, 0x9, 0xA, 0x3, 0x7, 0xB, 0xF])
PAYLOADS = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=100).map(str.encode),
    st.builds(lambda rid, op: json.dumps({"id": rid, "op": op}).encode(),
              st.integers(-2, 50), st.sampled_from(["ping", "reward", "reset", "nope"])),
    st.builds(lambda code, reason: code.to_bytes(2, "big") + reason,
              st.integers(0, 5000), st.binary(max_size=20)),
    st.binary(min_size=MAX_FRAME * 4 - 2, max_size=MAX_FRAME * 4 + 2),  # around the hard limit
)
FRAMES = st.builds(frame_bytes, OPCODES, PAYLOADS, fin=st.sampled_from([True, True, True, False]),
                   masked=st.sampled_from([True] * 9 + [False]), rsv=st.sampled_from([0] * 9 + [1, 4, 7]))
LYING_LENGTH = st.builds(  # a header claiming more (or an absurd amount) than follows
    lambda length: bytes((0x81, 0xFF)) + length.to_bytes(8, "big") + b"mask" + b"x" * 8,
    st.sampled_from([1 << 20, 1 << 40, (1 << 63) + 5, (1 << 64) - 1]))


@pytest.mark.slow  # about 15 s of examples
@FUZZ
@given(st.lists(st.one_of(FRAMES, FRAMES, FRAMES, LYING_LENGTH), min_size=1, max_size=8))
def test_any_frames_then_close_end_with_a_close_frame_from_the_server(target, frames):
    srv, bystander = target
    raw = open_session(srv)
    try:
        try:
            raw.sock.sendall(b"".join(frames) + frame_bytes(0x8, (1000).to_bytes(2, "big")))
        except (BrokenPipeError, ConnectionResetError):  # failed and closed before all was sent
            pass
        received = read_until_closed(raw)
    finally:
        raw.close()
    assert received and received[-1][0] == 0x8, f"dropped without a close frame: {received[-3:]}"
    close = received[-1][1]  # empty (echoing an empty close), or a code a peer may send
    code = int.from_bytes(close[:2], "big")
    assert not close or code in VALID_CLOSE or 3000 <= code < 5000, code
    for opcode, payload in received[:-1]:
        assert opcode in (0x1, 0xA), opcode
        if opcode == 0x1:
            json.loads(payload)  # replies are JSON
    assert Bystander.still_served(bystander)


@settings(FUZZ, max_examples=40)
@given(st.binary(min_size=1, max_size=600))
def test_any_bytes_then_eof_end_the_connection_within_seconds(target, data):
    srv, bystander = target
    raw = open_session(srv)
    try:
        try:
            raw.sock.sendall(data)
            raw.sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        started = time.monotonic()
        try:
            read_until_closed(raw, timeout=15)
        except TimeoutError:
            pytest.fail("the server kept the connection open after the peer's EOF")
        assert time.monotonic() - started < 15
    finally:
        raw.close()
    assert Bystander.still_served(bystander)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
WEIRD_TEXT = st.text(max_size=10) | st.builds(  # lone surrogates: JSON escapes can carry them, UTF-8 cannot
    lambda before, surrogate, after: before + surrogate + after,
    st.text(max_size=4), st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]), st.text(max_size=4))
REQUEST = st.fixed_dictionaries(
    {"op": st.sampled_from(["call", "call", "call", "reset", "reward", "ping", "nope"]) | WEIRD_TEXT},
    optional={"tool": st.sampled_from(["increment"]) | WEIRD_TEXT | JSON,
              "args": st.fixed_dictionaries({}, optional={"step": JSON}) | st.dictionaries(WEIRD_TEXT, JSON) | JSON,
              "kwargs": st.dictionaries(WEIRD_TEXT, JSON, max_size=3) | JSON})
TEXT_FRAME = st.one_of(
    REQUEST.map(lambda frame: ("request", frame)),
    st.text(max_size=40).map(lambda text: ("text", text)),  # mostly not JSON
    JSON.map(lambda value: ("text", json.dumps(value))),  # JSON but not a request
    st.integers(1, 3000).map(lambda depth: ("text", "[" * depth + "]" * depth)),
)


@FUZZ
@given(st.lists(TEXT_FRAME, min_size=1, max_size=6))
def test_every_text_frame_gets_one_typed_reply_with_its_id(target, frames):
    srv, bystander = target
    raw = open_session(srv)
    try:
        rid = 0
        expected = []
        for kind, frame in frames:
            if kind == "request":
                rid += 1
                frame = {"id": rid, **frame}
                text = json.dumps(frame)  # ASCII: lone surrogates travel as JSON escapes
                expected.append(rid)
            else:
                text = frame
                try:
                    parsed = json.loads(text)
                except (ValueError, RecursionError):
                    parsed = None
                expected.append(parsed["id"] if isinstance(parsed, dict) and "id" in parsed
                                and type(parsed["id"]) is int and parsed["id"] > 0 else None)
            raw.send_frame(0x1, text.encode())
            opcode, payload = raw.recv_frame()
            assert opcode == 0x1, (opcode, payload)
            reply = json.loads(payload)
            assert set(reply) in ({"id", "ok", "result"}, {"id", "ok", "error"}), reply
            if reply["ok"] is False:
                assert reply["error"]["code"] in CODES and isinstance(reply["error"]["message"], str)
            if expected[-1] is None or kind == "request":
                assert reply["id"] == expected[-1], (text[:200], reply)
        rid = max([rid, *[e for e in expected if e]]) + 1
        assert call(raw, rid, "ping")["result"] == "pong"  # the session still works
        assert call(raw, rid + 1, "close")["ok"] is True
    finally:
        raw.close()
    assert Bystander.still_served(bystander)


def test_after_the_fuzz_no_session_is_left_but_the_bystander(target):
    srv, _ = target
    assert wait_until(lambda: health(srv)["sessions"] == 1, timeout=10)
