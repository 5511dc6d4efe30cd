"""The server's own WebSocket protocol (``envserver._websocket``) at the RFC 6455 level.

Some cases speak raw frames over a socket (``wire.RawSocket``) to send what a well-behaved client
library never would: unmasked frames, bad UTF-8, unanswered pings.
"""

from __future__ import annotations

import asyncio
import json
import threading
import tracemalloc

import pytest
import websockets

from tests.envserver.servers import health, http_get, make_server, request, ws_url
from tests.envserver.wire import RawSocket, call, frame_bytes, open_session


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


def test_a_request_before_a_bad_frame_is_answered_before_the_close(small):
    raw = open_session(small)
    request_frame = json.dumps({"id": 1, "op": "call", "tool": "increment", "args": {"step": 5}}).encode()
    raw.sock.sendall(frame_bytes(0x1, request_frame) + frame_bytes(0x1, b'{"id": 2, "op": "ping"}', masked=False))
    opcode, payload = raw.recv_frame()
    assert (opcode, json.loads(payload)) == (0x1, {"id": 1, "ok": True, "result": "5"})  # once: lost to the close
    assert raw.close_code() == 1002
    raw.close()


def bare_frames(first: int, payload: bytes, count: int) -> bytes:
    """``count`` copies of one small client frame, masked with the zero key (cheap to build by the million)."""
    return (bytes((first, 0x80 | len(payload))) + b"\0\0\0\0" + payload) * count


def test_two_byte_fragments_by_the_ten_thousand_cost_their_payload_not_more(server):
    # Before: each fragment was kept as an object of its own (~60 bytes for two of payload): 2 million
    # of them held +140 MiB for 3.8 MiB of payload.
    text = json.dumps({"id": 1, "op": "ping"}).encode().ljust(40_000)  # JSON allows the padding
    fragments = b"".join(bytes((0x00, 0x82)) + b"\0\0\0\0" + text[i:i + 2] for i in range(2, len(text) - 2, 2))
    raw = open_session(server)
    raw.sock.settimeout(60)  # tracemalloc slows the server several times over
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        raw.send_frame(0x1, text[:2], fin=False)
        raw.sock.sendall(fragments)
        raw.send_frame(0x9, b"all read")  # answered once every fragment before it is parsed
        assert raw.recv_frame() == (0xA, b"all read")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    raw.send_frame(0x0, text[-2:])
    assert json.loads(raw.recv_frame()[1]) == {"id": 1, "ok": True, "result": "pong"}
    assert call(raw, 2, "close")["ok"] is True
    raw.close()
    assert held < 400_000  # the 40 kB of payload and change (before: 1.2 MB)


def test_a_message_after_a_fragmented_one_is_not_counted_with_it(small):
    raw = open_session(small)  # hard limit 16 KiB
    request = json.dumps({"id": 1, "op": "ping"}).encode().ljust(12_000)
    raw.send_frame(0x1, request[:6000], fin=False)
    raw.send_frame(0x0, request[6000:])
    assert json.loads(raw.recv_frame()[1])["error"]["code"] == "frame_too_large"  # above max_frame_bytes
    raw.send_frame(0x1, json.dumps({"id": 2, "op": "ping"}).encode().ljust(8_000))  # once: 8,000 + 12,000: 1009
    assert json.loads(raw.recv_frame()[1])["error"]["code"] == "frame_too_large"
    assert call(raw, 3, "ping")["result"] == "pong"
    assert call(raw, 4, "close")["ok"] is True
    raw.close()


def test_a_flood_of_tiny_frames_does_not_hold_up_other_connections(server):
    # Before: the server handled a whole read of them (40,000 frames, ~80 ms) in each loop turn, and a
    # /health takes a few dozen turns: 2 million unsolicited pongs held /health back 2.3 s.
    raw = open_session(server)
    end: list[tuple[int, bytes]] = []

    def flood() -> None:
        raw.sock.sendall(bare_frames(0x8A, b"", 1_000_000))
        raw.send_frame(0x9, b"end of flood")
        end.append(raw.recv_frame())  # the pong comes once the whole flood is handled

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    answered = 0
    while thread.is_alive():
        assert http_get(server.url + "/health")[0] == 200
        answered += 1
    assert end == [(0xA, b"end of flood")]
    assert call(raw, 1, "close")["ok"] is True
    raw.close()
    assert answered >= 3  # before: 0 or 1 while the flood lasted
