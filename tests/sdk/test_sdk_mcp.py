"""``sdk.MCPEnvironment`` against a real MCP server (``tests/sdk/mcp_server.py``, the ``mcp`` package's ``MCPServer``).

Over stdio (a server process per environment, or one shared) and over streamable HTTP; the server
misbehaves on demand: a tool that raises, one that never answers in time, one that kills the process.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sdk import environment_tools
from sdk.exceptions import ServerUnavailableError, ToolCallError, ToolTimeoutError, UnknownToolError
from sdk.mcp import MCPEnvironment
from tests.sdk.openenv_side import free_port
from trainer.rollout.env_pool import EnvironmentPool

SERVER = Path(__file__).resolve().parent / "mcp_server.py"
COMMAND = [sys.executable, str(SERVER)]


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def gone(pid: int, timeout: float = 15.0) -> bool:
    """Wait until process ``pid`` has exited (and was reaped)."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def whoami(env: MCPEnvironment) -> dict[str, object]:
    return dict(json.loads(await env.call("whoami")))


def test_stdio_server_tools_become_the_environments_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLGYM_TOKEN", "the trainer's secret")

    async def episode() -> int:
        async with MCPEnvironment(COMMAND, env={"MCP_TEST_VALUE": "named"}, cwd=str(tmp_path)) as env:
            assert await env.reset(target=3) is None  # no episodes: the dataset's prompt stays
            tools = {t.name: t for t in environment_tools(env)}
            assert set(tools) == {"increment", "fail", "slow", "crash", "whoami"}
            assert tools["increment"].schema["function"]["parameters"]["properties"]["step"]["type"] == "integer"
            assert await tools["increment"].func(step=2) == "2"
            assert await env.call("increment", {"step": 3}) == "5"  # one process: its state goes on
            with pytest.raises(ToolCallError, match="fail: Error executing tool fail"):  # isError
                await env.call("fail", {"message": "boom"})
            with pytest.raises(ToolCallError, match="(?s)increment: .*valid integer"):
                await env.call("increment", {"step": "x"})
            with pytest.raises(UnknownToolError, match="unknown tool 'nope'; available: increment"):
                await env.call("nope", {})
            me = await whoami(env)
            assert me["env"] == {"MCP_TEST_VALUE": "named"}  # only what was named: no TOOLGYM_TOKEN
            assert me["cwd"] == str(tmp_path)
            return int(me["pid"])  # type: ignore[call-overload]

    pid = run(episode())
    assert gone(pid)  # closing the environment stopped its server


def test_a_call_past_the_timeout_or_a_crash_is_a_tool_failure_then_a_fresh_server() -> None:
    async def episode() -> None:
        async with MCPEnvironment(COMMAND, call_timeout=2.0) as env:
            await env.reset()
            first = int((await whoami(env))["pid"])  # type: ignore[call-overload]
            started = time.monotonic()
            with pytest.raises(ToolTimeoutError, match="slow: no answer .* within 2 s; it is restarted"):
                await env.call("slow", {"seconds": 60})
            assert time.monotonic() - started < 8
            assert await env.call("increment", {"step": 1}) == "1"  # a new process: the counter started over
            second = int((await whoami(env))["pid"])  # type: ignore[call-overload]
            assert second != first and gone(first)
            with pytest.raises(ToolCallError, match="crash: MCP server .* exited during the call"):
                await env.call("crash")
            assert await env.call("increment", {"step": 1}) == "1"
            assert int((await whoami(env))["pid"]) not in (first, second)  # type: ignore[call-overload]

    run(episode())


def test_one_server_per_instance_or_one_shared() -> None:
    async def pids(shared: bool) -> tuple[int, int]:
        one, two = MCPEnvironment(COMMAND, shared=shared), MCPEnvironment(COMMAND, shared=shared)
        await one.reset()
        await two.reset()
        a, b = int((await whoami(one))["pid"]), int((await whoami(two))["pid"])  # type: ignore[call-overload]
        await one.aclose()
        assert alive(b)  # the other instance's server (the shared one) is still up
        if shared:
            assert await two.call("increment", {"step": 1}) == "1"
        await two.aclose()
        return a, b

    a, b = run(pids(shared=False))
    assert a != b and gone(a) and gone(b)
    a, b = run(pids(shared=True))
    assert a == b and gone(a)  # reaped when the last environment closed


def test_a_server_that_cannot_start_is_a_clear_error() -> None:
    env = MCPEnvironment([sys.executable, "-c", "import sys; sys.exit(2)"], connect_timeout=20)
    with pytest.raises(ServerUnavailableError, match="could not start or reach MCP server"):
        run(env.reset())


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    """The same server over streamable HTTP."""
    port = free_port()
    process = subprocess.Popen([*COMMAND, "--http", str(port)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                run(MCPEnvironment(url, connect_timeout=2).reset())
                break
            except ServerUnavailableError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_streamable_http_server_and_the_trainers_pooling(http_server: str) -> None:
    factories = {"mcp": functools.partial(MCPEnvironment, http_server)}
    pool = EnvironmentPool(pickle.loads(pickle.dumps(factories)))

    async def rollouts() -> None:
        env = pool.acquire("mcp")
        await env.reset()
        assert [t.name for t in environment_tools(env)][:2] == ["increment", "fail"]
        before = int(await env.call("increment", {"step": 0}))
        assert int(await env.call("increment", {"step": 2})) == before + 2
        pool.release("mcp", env)
        assert pool.acquire("mcp") is env
        await pool.aclose()

    run(rollouts())
