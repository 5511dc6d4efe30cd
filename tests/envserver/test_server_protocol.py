"""The wire protocol against a real server: hello, requests, typed errors, replay, close."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import websockets

from sdk import protocol
from tests.envserver.servers import health, http_get, make_server, request, ws_url


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_hello_carries_version_session_tools_and_limits(server):
    async def scenario():
        async with websockets.connect(ws_url(server, "counter")) as ws:
            hello = json.loads(await ws.recv())
            await request(ws, 1, "close")
        return hello

    hello = run(scenario())
    assert hello["op"] == "hello" and hello["v"] == protocol.PROTOCOL_VERSION
    assert hello["env"] == "counter" and hello["resumed"] is False and hello["last_id"] == 0
    assert len(hello["session"]) >= 20
    assert [t["function"]["name"] for t in hello["tools"]] == ["increment"]
    assert hello["has_reward"] is True
    assert hello["limits"]["call_timeout"] == 2.0


def test_episode_reset_call_reward_close(server):
    async def scenario():
        async with websockets.connect(ws_url(server, "counter")) as ws:
            await ws.recv()
            replies = [
                await request(ws, 1, "reset", kwargs={"target": 3}),
                await request(ws, 2, "call", tool="increment", args={"step": 2}),
                await request(ws, 3, "reward"),
                await request(ws, 4, "call", tool="increment", args={"step": 1}),
                await request(ws, 5, "reward"),
                await request(ws, 6, "ping"),
                await request(ws, 7, "close"),
            ]
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
        return replies, closed.value

    replies, closed = run(scenario())
    assert [r["id"] for r in replies] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["result"] for r in replies] == ["Increment the counter to 3.", "2", 0.0, "3", 1.0, "pong", None]
    assert closed.rcvd.code == protocol.CLOSE_SESSION_ENDED


BAD_FRAMES = [
    ("not json", "bad_frame", None),
    ("[1, 2]", "bad_frame", None),
    ('{"op": "reset"}', "bad_frame", None),
    ('{"id": "7", "op": "reset"}', "bad_frame", None),
    ('{"id": 7, "op": "dance"}', "unknown_op", 7),
    ('{"id": 7}', "unknown_op", 7),
    ('{"id": 7, "op": "call", "tool": "explode", "args": {}}', "unknown_tool", 7),
    ('{"id": 7, "op": "call", "tool": "increment", "args": {"step": "two"}}', "invalid_arguments", 7),
    ('{"id": 7, "op": "call", "tool": "increment", "args": {"step": true}}', "invalid_arguments", 7),
    ('{"id": 7, "op": "call", "tool": "increment", "args": {}}', "invalid_arguments", 7),
    ('{"id": 7, "op": "call", "tool": "increment", "args": {"step": 1, "extra": 2}}', "invalid_arguments", 7),
    ('{"id": 7, "op": "call", "tool": "increment", "args": [1]}', "invalid_arguments", 7),
    ('{"id": 7, "op": "reset", "kwargs": [1]}', "bad_frame", 7),
    ("x" * 5000, "frame_too_large", None),
]


@pytest.fixture(scope="module")
def small_frame_server():
    """A server with a 4 KiB frame limit, for the oversized-frame case."""
    srv = make_server(max_frame_bytes=4096)
    yield srv
    srv.stop()


@pytest.mark.parametrize(("frame", "code", "rid"), BAD_FRAMES)
def test_bad_frame_gets_typed_error_and_session_keeps_working(small_frame_server, frame, code, rid):
    async def scenario(srv):
        async with websockets.connect(ws_url(srv, "counter")) as ws, \
                   websockets.connect(ws_url(srv, "counter")) as other:
            await ws.recv(), await other.recv()
            await request(ws, 1, "reset", kwargs={"target": 1})
            await ws.send(frame)
            error = json.loads(await ws.recv())
            # The same session and a bystander session still work.
            after = await request(ws, 10, "call", tool="increment", args={"step": 1})
            bystander = await request(other, 1, "reset", kwargs={})
            await request(ws, 11, "close"), await request(other, 2, "close")
        return error, after, bystander

    error, after, bystander = run(scenario(small_frame_server))
    assert error["ok"] is False and error["id"] == rid
    assert error["error"]["code"] == code and error["error"]["message"]
    assert after == {"id": 10, "ok": True, "result": "1"}
    assert bystander["ok"] is True


def test_binary_frame_and_stale_id_are_refused(server):
    async def scenario():
        async with websockets.connect(ws_url(server, "counter")) as ws:
            await ws.recv()
            await ws.send(b'{"id": 1, "op": "ping"}')
            binary = json.loads(await ws.recv())
            await request(ws, 5, "ping")
            stale = await request(ws, 3, "ping")
            await request(ws, 6, "close")
        return binary, stale

    binary, stale = run(scenario())
    assert binary["error"]["code"] == "bad_frame" and "binary" in binary["error"]["message"]
    assert stale["error"]["code"] == "bad_frame" and "below the last one" in stale["error"]["message"]


def test_tool_exception_is_a_tool_error_and_the_session_survives(server):
    async def scenario():
        async with websockets.connect(ws_url(server, "probe")) as ws:
            await ws.recv()
            await request(ws, 1, "reset")
            failed = await request(ws, 2, "call", tool="fail", args={"message": "boom"})
            echoed = await request(ws, 3, "call", tool="echo", args={"text": "ab", "times": 2})
            await request(ws, 4, "close")
        return failed, echoed

    failed, echoed = run(scenario())
    assert failed["error"] == {"code": "tool_error", "message": "ValueError: boom"}
    assert echoed["result"] == "abab"


@pytest.mark.parametrize(("path", "code", "hint"), [
    ("/v1/ws/countr?v=1", "unknown_environment", "did you mean 'counter'"),
    ("/v1/ws/counter/extra?v=1", "unknown_environment", "no environment named 'counter/extra'"),
    ("/v1/ws/counter?v=99", "unsupported_version", "v=1"),
    ("/v1/ws/counter?v=1&session=nope", "session_not_found", "no such session"),
])
def test_refused_session_gets_a_bye_frame(server, path, code, hint):
    async def scenario():
        async with websockets.connect(server.url.replace("http", "ws") + path) as ws:
            bye = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
        return bye

    bye = run(scenario())
    assert bye["op"] == "bye" and bye["error"]["code"] == code and hint in bye["error"]["message"]


def test_resume_after_drop_keeps_state_and_replays_instead_of_rerunning(server):
    async def scenario():
        ws = await websockets.connect(ws_url(server, "probe"))
        session = json.loads(await ws.recv())["session"]
        await request(ws, 1, "reset")
        await ws.send(json.dumps({"id": 2, "op": "call", "tool": "echo", "args": {"text": "x"}}))
        await asyncio.sleep(0.2)  # the call runs; its reply is lost with the connection
        ws.transport.abort()
        async with websockets.connect(ws_url(server, "probe", f"v=1&session={session}")) as again:
            hello = json.loads(await again.recv())
            replay = await request(again, 2, "call", tool="echo", args={"text": "x"})
            count = await request(again, 3, "call", tool="count", args={})
            await request(again, 4, "close")
        return hello, replay, count

    hello, replay, count = run(scenario())
    assert hello["resumed"] is True and hello["last_id"] == 2
    assert replay == {"id": 2, "ok": True, "result": "x"}
    assert count["result"] == "1"  # echo ran once, not twice


def test_resume_takes_over_a_still_attached_session(server):
    async def scenario():
        first = await websockets.connect(ws_url(server, "counter"))
        session = json.loads(await first.recv())["session"]
        await request(first, 1, "reset", kwargs={"target": 2})
        await request(first, 2, "call", tool="increment", args={"step": 2})
        async with websockets.connect(ws_url(server, "counter", f"v=1&session={session}")) as second:
            await second.recv()
            bye = json.loads(await first.recv())
            reward = await request(second, 3, "reward")
            await request(second, 4, "close")
        await first.close()
        return bye, reward

    bye, reward = run(scenario())
    assert bye["op"] == "bye" and bye["error"]["code"] == "session_evicted"
    assert reward["result"] == 1.0


def test_closed_session_cannot_be_resumed(server):
    async def scenario():
        async with websockets.connect(ws_url(server, "counter")) as ws:
            session = json.loads(await ws.recv())["session"]
            await request(ws, 1, "close")
        async with websockets.connect(ws_url(server, "counter", f"v=1&session={session}")) as ws:
            return json.loads(await ws.recv())

    assert run(scenario())["error"]["code"] == "session_not_found"


def test_env_without_reward_returns_null_and_reset_may_return_none(server):
    async def scenario():
        async with websockets.connect(ws_url(server, "noreward")) as ws:
            hello = json.loads(await ws.recv())
            replies = [await request(ws, 1, "reset"), await request(ws, 2, "reward"),
                       await request(ws, 3, "call", tool="ping", args={})]
            await request(ws, 4, "close")
        return hello, replies

    hello, replies = run(scenario())
    assert hello["has_reward"] is False
    assert [r["result"] for r in replies] == [None, None, "pong"]


def test_envs_route_lists_hosted_schemas(server):
    status, body = http_get(server.url + "/v1/envs")
    data = json.loads(body)
    assert status == 200 and data["protocol"] == protocol.PROTOCOL_VERSION
    assert set(data["environments"]) == {"counter", "probe", "noreward"}
    probe_tools = [t["function"]["name"] for t in data["environments"]["probe"]["tools"]]
    assert probe_tools == ["echo", "fail", "nap", "anap", "count"]
    assert health(server)["sessions"] == 0
