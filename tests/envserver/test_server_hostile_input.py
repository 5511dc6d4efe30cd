"""Input the JSON layer chokes on, replies that cannot be encoded, resends after a resume, slow neighbours.

Each of these once dropped the connection with a traceback, answered a resent id with another id's
reply, or let one environment's slow tools hold up another environment's sessions.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from typing import Any

import pytest
import websockets

from environments.counter import IncrementEnv
from envserver import EnvSpec, ServerConfig, ServerThread
from tests.envserver.servers import ProbeEnv, health, request, ws_url

RELEASE = threading.Event()  # lets the blocked tools of HostileEnv return


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("nor for this")


class HostileEnv:
    """An environment whose tools return what cannot be sent, raise oddly, or block until released."""

    def __init__(self) -> None:
        self.reward = 0.0

    def reset(self, **kwargs: Any) -> str:
        """Start an episode; ``surrogate=True`` returns text with a lone surrogate."""
        self.reward = float(kwargs.get("reward", 0.0))
        return "\ud800" if kwargs.get("surrogate") else "ready"

    def get_reward(self) -> float:
        """Whatever reset was told (NaN included)."""
        return self.reward

    def unprintable(self) -> object:
        """Return an object whose str() raises."""
        return _Unprintable()

    def lone_surrogate(self) -> str:
        """Return text that cannot be encoded as UTF-8."""
        return "ok \udc80"

    def raise_unprintable(self) -> str:
        """Raise an exception whose str() raises."""
        raise _UnprintableError()

    def exit(self) -> str:
        """Call sys.exit (as model-written code might)."""
        sys.exit(3)

    def block(self) -> str:
        """Block (a slow sandbox call) until the test releases it."""
        RELEASE.wait(30)
        return "released"


@pytest.fixture(scope="module")
def hostile():
    specs = {name: EnvSpec.from_factory(name, factory)
             for name, factory in (("hostile", HostileEnv), ("probe", ProbeEnv), ("counter", IncrementEnv))}
    config = ServerConfig(port=0, threads=4, call_timeout=30.0, resume_grace=5.0, drain_timeout=0.2)
    with ServerThread(specs, config) as srv:
        yield srv
        RELEASE.set()


async def session(srv: Any, env: str) -> Any:
    ws = await websockets.connect(ws_url(srv, env), max_size=None)
    assert json.loads(await ws.recv())["op"] == "hello"
    return ws


def test_deeply_nested_json_is_a_bad_frame_and_the_session_goes_on(hostile):
    async def scenario():
        ws = await session(hostile, "counter")
        await ws.send("[" * 200_000 + "]" * 200_000)
        nested = json.loads(await ws.recv())
        # Deep, yet under the parser's limit: the argument validator recurses into it.
        await ws.send('{"id": 1, "op": "call", "tool": "increment", "args": {"step": '
                      + '{"a": ' * 900 + "1" + "}" * 900 + "}}")
        deep_args = json.loads(await ws.recv())
        after = await request(ws, 2, "call", tool="increment", args={"step": 1})
        await request(ws, 3, "close")
        return nested, deep_args, after

    nested, deep_args, after = asyncio.run(scenario())
    assert nested["id"] is None and nested["error"]["code"] == "bad_frame" and "nested" in nested["error"]["message"]
    assert deep_args["id"] == 1 and deep_args["error"]["code"] in ("bad_frame", "invalid_arguments")
    assert after == {"id": 2, "ok": True, "result": "1"}


def test_a_lone_surrogate_in_an_argument_name_is_escaped_in_the_error(hostile):
    async def scenario():
        ws = await session(hostile, "counter")
        await ws.send('{"id": 1, "op": "call", "tool": "increment", "args": {"step": 1, "\\ud800x": 2}}')
        reply = json.loads(await ws.recv())
        await ws.send('{"id": 2, "op": "call", "tool": "\\udfff", "args": {}}')
        unknown = json.loads(await ws.recv())
        await ws.send('{"id": 3, "op": "reset", "kwargs": {"\\ud800": 1}}')
        bad_kwargs = json.loads(await ws.recv())
        after = await request(ws, 4, "call", tool="increment", args={"step": 1})
        await request(ws, 5, "close")
        return reply, unknown, bad_kwargs, after

    reply, unknown, bad_kwargs, after = asyncio.run(scenario())
    assert reply["error"]["code"] == "invalid_arguments" and "\\ud800x" in reply["error"]["message"]
    assert unknown["error"]["code"] == "unknown_tool"
    assert bad_kwargs["id"] == 3  # the counter ignores kwargs it does not know
    assert after["ok"] is True


@pytest.mark.parametrize(("op", "fields", "code", "text"), [
    ("call", {"tool": "unprintable"}, "tool_error", "whose str() raised RuntimeError: no text for you"),
    ("call", {"tool": "lone_surrogate"}, "tool_error", "not valid Unicode"),
    ("call", {"tool": "raise_unprintable"}, "tool_error", "_UnprintableError: <str() of the exception raised"),
    ("call", {"tool": "exit"}, "tool_error", "SystemExit: 3"),
    ("reset", {"kwargs": {"surrogate": True}}, "environment_error", "not valid Unicode"),
])
def test_replies_that_cannot_be_encoded_are_typed_errors(hostile, op, fields, code, text):
    async def scenario():
        ws = await session(hostile, "hostile")
        reply = await request(ws, 1, op, **fields)
        after = await request(ws, 2, "ping")
        await request(ws, 3, "close")
        return reply, after

    reply, after = asyncio.run(scenario())
    assert reply["id"] == 1 and reply["error"]["code"] == code and text in reply["error"]["message"]
    assert after["result"] == "pong"


@pytest.mark.parametrize("reward", ["NaN", "Infinity"])
def test_a_non_finite_reward_is_an_environment_error(hostile, reward):
    async def scenario():
        ws = await session(hostile, "hostile")
        await request(ws, 1, "reset", kwargs={"reward": reward})
        reply = await request(ws, 2, "reward")
        await request(ws, 3, "close")
        return reply

    reply = asyncio.run(scenario())
    assert reply["error"]["code"] == "environment_error" and "finite" in reply["error"]["message"]


def test_a_resent_id_gets_its_own_reply_never_another_ids(hostile):
    async def scenario():
        first = await websockets.connect(ws_url(hostile, "probe"))
        session_id = json.loads(await first.recv())["session"]
        assert (await request(first, 1, "call", tool="echo", args={"text": "one"}))["result"] == "one"
        # id 2 fails in a way that once escaped as a traceback, then the client drops and resumes.
        await first.send(json.dumps({"id": 2, "op": "call", "tool": "nap", "args": {"seconds": 0.5}}))
        await first.send(json.dumps({"id": 3, "op": "call", "tool": "echo", "args": {"text": "three"}}))
        second = await websockets.connect(ws_url(hostile, "probe", f"v=1&session={session_id}"))
        hello = json.loads(await second.recv())  # the first connection is taken over (bye)
        replies = [await request(second, 2, "call", tool="nap", args={"seconds": 0.5}),  # resent: replayed
                   await request(second, 3, "call", tool="echo", args={"text": "three"}),  # never ran: runs now
                   await request(second, 3, "call", tool="echo", args={"text": "three"}),  # resent again
                   await request(second, 2, "ping"),  # below the last id: a typed error of its own
                   await request(second, 4, "call", tool="count")]
        await request(second, 5, "close")
        await first.close()
        return hello, replies

    hello, replies = asyncio.run(scenario())
    assert hello["resumed"] is True and hello["last_id"] in (1, 2)
    assert [r["id"] for r in replies] == [2, 3, 3, 2, 4]
    assert replies[0]["result"] == "rested"
    assert replies[1]["result"] == replies[2]["result"] == "three"
    assert replies[3]["error"]["code"] == "bad_frame"
    assert replies[4]["result"] == "3"  # echo, nap, echo: each ran once


def test_a_resent_id_whose_run_failed_oddly_gets_its_own_error_not_the_previous_reply(hostile):
    async def scenario():
        first = await websockets.connect(ws_url(hostile, "hostile"))
        session_id = json.loads(await first.recv())["session"]
        await request(first, 1, "reset")
        # Once, this call's failure escaped as a traceback: the connection dropped, and the resent
        # id 2 was answered with the stored reply to id 1.
        await first.send(json.dumps({"id": 2, "op": "call", "tool": "unprintable"}))
        await asyncio.sleep(0.2)
        await first.close()
        again = await websockets.connect(ws_url(hostile, "hostile", f"v=1&session={session_id}"))
        hello = json.loads(await again.recv())
        replies = [await request(again, 2, "call", tool="unprintable"), await request(again, 3, "ping")]
        await request(again, 4, "close")
        return hello, replies

    hello, replies = asyncio.run(scenario())
    assert hello["last_id"] == 2
    assert replies[0]["id"] == 2 and replies[0]["error"]["code"] == "tool_error"
    assert replies[1] == {"id": 3, "ok": True, "result": "pong"}


def test_an_environments_slow_tools_do_not_delay_another_environments_sessions(hostile):
    async def scenario():
        blocked = [await session(hostile, "hostile") for _ in range(6)]  # 6 calls, 4 threads: 2 wait
        for ws in blocked:
            await ws.send(json.dumps({"id": 1, "op": "call", "tool": "block"}))
        await asyncio.sleep(0.2)
        # Before: one pool for every environment, so the counter's constructor waited for a thread.
        counter = await asyncio.wait_for(session(hostile, "counter"), 10)
        reply = await asyncio.wait_for(request(counter, 1, "call", tool="increment", args={"step": 1}), 10)
        still_blocked = not RELEASE.is_set()
        RELEASE.set()
        released = [json.loads(await asyncio.wait_for(ws.recv(), 30))["result"] for ws in blocked]
        for ws in [*blocked, counter]:
            await request(ws, 9, "close")
        return reply, still_blocked, released

    reply, still_blocked, released = asyncio.run(scenario())
    assert reply["result"] == "1" and still_blocked
    assert released == ["released"] * 6
    assert health(hostile)["sessions"] == 0



@pytest.mark.parametrize("tool", [[], {}, ["increment"], 3, None])
def test_a_tool_name_that_is_not_a_string_is_an_unknown_tool(hostile, tool):
    async def scenario():
        ws = await session(hostile, "counter")
        reply = await request(ws, 1, "call", tool=tool, args={})
        after = await request(ws, 2, "ping")
        await request(ws, 3, "close")
        return reply, after

    reply, after = asyncio.run(scenario())  # a list once reached a set lookup and dropped the connection
    assert reply["id"] == 1 and reply["error"]["code"] == "unknown_tool"
    assert after["result"] == "pong"
