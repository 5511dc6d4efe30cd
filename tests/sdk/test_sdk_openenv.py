"""``sdk.OpenEnvEnvironment`` against real OpenEnv 0.10 servers on loopback (``tests/sdk/openenv_servers.py``).

The servers run in the OpenEnv venv (``tests/sdk/openenv_side.py``): an action-style counter, an
MCP-style counter with tools that fail on demand, and the MCP one again with room for one session.
The misbehaving peers (a server that answers with frames OpenEnv does not send, one that drops the
connection) are small ``websockets`` servers in this process.
"""

from __future__ import annotations

import asyncio
import functools
import json
import pickle
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from sdk import environment_tools
from sdk.exceptions import (
    InvalidArgumentsError,
    ProtocolError,
    ServerFullError,
    ServerUnavailableError,
    SessionLostError,
    ToolCallError,
    ToolTimeoutError,
    UnknownToolError,
)
from sdk.openenv import OpenEnvEnvironment
from tests.sdk.openenv_side import free_port, openenv_servers, servers_script
from trainer.rollout.env_pool import EnvironmentPool


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    """Base URLs: ``action``, ``mcp`` and ``mcp1`` (room for one session)."""
    script = servers_script()
    with openenv_servers([script, "--style", "action"], [script, "--style", "mcp"],
                         [script, "--style", "mcp", "--max-sessions", "1"]) as (action, mcp, mcp1):
        yield {"action": action, "mcp": mcp, "mcp1": mcp1}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.slow
def test_action_style_environment_has_one_step_tool_with_the_action_schema(urls: dict[str, str]) -> None:
    async def episode() -> None:
        async with OpenEnvEnvironment(urls["action"]) as env:
            prompt = await env.reset(target=2)
            assert prompt == '{"counter":0,"prompt":"Increment the counter to 2."}'
            [tool] = environment_tools(env)
            assert tool.name == "step" and tool.is_async
            parameters = tool.schema["function"]["parameters"]
            assert parameters["properties"] == {"step": {"description": "Value to add to the counter.",
                                                         "title": "Step", "type": "integer"}}
            assert parameters["required"] == ["step"]  # the framework's `metadata` field is not the model's
            assert await tool.func(step=1) == '{"counter":1}'
            assert await env.get_reward() == 0.0
            with pytest.raises(InvalidArgumentsError, match="step: step: Input should be a valid integer"):
                await env.call("step", {"step": "x"})
            with pytest.raises(ToolCallError, match="step: unlucky step"):  # the environment raised
                await env.call("step", {"step": 13})
            with pytest.raises(UnknownToolError, match="available: step"):
                await env.call("increment", {"step": 1})
            assert await env.call("step", {"step": 1}) == '{"counter":2}'
            assert (await env.get_reward(), env.done) == (1.0, True)
            assert (await env.state())["step_count"] == 2
            with pytest.raises(ToolCallError, match="the episode is over"):  # done ends the episode
                await env.call("step", {"step": 1})
            await env.reset(target=5)  # the same session, a new episode
            assert (env.done, await env.get_reward()) == (False, None)

    run(episode())


@pytest.mark.slow
def test_mcp_style_environment_lists_its_tools_and_scores_each_call(urls: dict[str, str]) -> None:
    async def episode() -> None:
        async with OpenEnvEnvironment(urls["mcp"], reward="sum") as env:
            assert await env.reset(target=2) == "Increment the counter to 2."
            tools = {t.name: t.schema["function"] for t in environment_tools(env)}
            assert set(tools) == {"increment", "fail", "slow"}
            assert tools["increment"]["description"] == "Increment the internal counter."
            assert tools["increment"]["parameters"]["properties"]["step"] == {
                "type": "integer", "description": "Value to add to the counter."}
            assert await env.call("increment", {"step": 1}) == "1"
            assert await env.call("increment", {"step": 1}) == "2"
            assert await env.get_reward() == 1.0  # sum: 0 at reset, 0 after 1, 1 after 2
            assert env.done

    run(episode())


@pytest.mark.slow
def test_mcp_tool_failures_are_tool_errors_and_the_session_goes_on(urls: dict[str, str]) -> None:
    async def episode() -> None:
        async with OpenEnvEnvironment(urls["mcp"]) as env:
            await env.reset(target=3)
            with pytest.raises(ToolCallError, match="fail: boom"):
                await env.call("fail", {"message": "boom"})
            with pytest.raises(UnknownToolError, match="nope: Unknown tool"):
                await env.call("nope", {})
            with pytest.raises(ToolCallError, match="increment: 1 validation error"):
                await env.call("increment", {"step": "x"})
            assert await env.call("increment", {"step": 3}) == "3"

    run(episode())


@pytest.mark.slow
def test_a_step_past_the_message_timeout_is_a_tool_timeout_then_the_episode_is_lost(urls: dict[str, str]) -> None:
    async def episode() -> None:
        async with OpenEnvEnvironment(urls["mcp"], message_timeout=5.0) as env:  # room for a loaded machine
            await env.reset(target=3)
            started = time.monotonic()
            with pytest.raises(ToolTimeoutError, match="slow: no answer within 5 s"):
                await env.call("slow", {"seconds": 60})
            assert time.monotonic() - started < 15
            with pytest.raises(SessionLostError, match="cannot resume"):  # never a silent fresh episode
                await env.call("increment", {"step": 1})
            assert await env.reset(target=1) == "Increment the counter to 1."  # a new session
            assert await env.call("increment", {"step": 1}) == "1"

    run(episode())


@pytest.mark.slow
def test_a_server_at_capacity_refuses_with_server_full(urls: dict[str, str]) -> None:
    async def two_sessions() -> None:
        async with OpenEnvEnvironment(urls["mcp1"]) as first, OpenEnvEnvironment(urls["mcp1"]) as second:
            await first.reset(target=1)
            with pytest.raises(ServerFullError, match="CAPACITY_REACHED"):
                await second.reset(target=1)
            await first.aclose()
            await second.reset(target=1)  # the slot is free again: a new session opens

    run(two_sessions())


def test_a_server_that_is_down_fails_within_the_connect_timeout() -> None:
    env = OpenEnvEnvironment(f"http://127.0.0.1:{free_port()}", connect_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="could not reach OpenEnv server .* within 1 s"):
        run(env.reset())
    assert time.monotonic() - started < 3


async def _serve_once(handler: Any, check: Any) -> None:
    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with OpenEnvEnvironment(f"http://127.0.0.1:{port}", connect_timeout=2, message_timeout=5) as env:
            await check(env)


def test_frames_openenv_does_not_send_are_a_protocol_error() -> None:
    async def handler(ws: ServerConnection) -> None:
        async for _ in ws:
            await ws.send(json.dumps({"type": "mystery", "data": {}}))

    async def check(env: OpenEnvEnvironment) -> None:
        with pytest.raises(ProtocolError, match="expected a frame of type 'observation'"):
            await env.reset()

    run(_serve_once(handler, check))


def test_a_connection_dropped_mid_episode_is_reported_not_replaced() -> None:
    async def handler(ws: ServerConnection) -> None:
        await ws.recv()  # reset
        await ws.send(json.dumps({"type": "observation", "data": {"observation": {"prompt": "go"},
                                                                   "reward": None, "done": False}}))
        await ws.recv()  # tools/list
        await ws.send(json.dumps({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "result": {
            "tools": [{"name": "poke", "description": "Poke.", "inputSchema": {"type": "object"}}]}}}))
        await ws.recv()  # the call: the server goes away instead of answering

    async def check(env: OpenEnvEnvironment) -> None:
        assert await env.reset() == "go"
        with pytest.raises(SessionLostError, match="OpenEnv sessions cannot resume"):
            await env.call("poke", {})
        with pytest.raises(SessionLostError):
            await env.call("poke", {})

    run(_serve_once(handler, check))


@pytest.mark.slow
def test_usable_as_environment_factories_with_the_trainers_pooling(urls: dict[str, str]) -> None:
    factories = {"action": functools.partial(OpenEnvEnvironment, urls["action"]),
                 "mcp": functools.partial(OpenEnvEnvironment, urls["mcp"])}
    pool = EnvironmentPool(pickle.loads(pickle.dumps(factories)))  # as the rollout worker gets them

    async def rollouts() -> None:
        first = pool.acquire("mcp")
        await first.reset(target=1)
        assert await first.call("increment", {"step": 1}) == "1"
        pool.release("mcp", first)
        again = pool.acquire("mcp")
        assert again is first  # the instance (and its OpenEnv session) is reused across episodes
        await again.reset(target=2)
        other = pool.acquire("action")
        await other.reset(target=1)
        assert [t.name for t in environment_tools(other)] == ["step"]
        await pool.aclose()

    run(rollouts())
