"""The env server as an OpenEnv server (``/openenv/NAME``), driven by OpenEnv 0.10's own clients.

OpenEnv's ``GenericEnvClient`` and ``MCPToolClient`` run in the OpenEnv venv (``tests/sdk/openenv_side.py``)
against a server on loopback here; toolgym's own ``OpenEnvEnvironment``, raw WebSockets and plain
HTTP check the rest: the error frames, the limits, the token, the metrics, the HTTP routes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import connect

from environments.counter import IncrementEnv
from environments.gridworld import GridWorldEnv
from envserver import EnvSpec, ServerConfig, ServerThread
from sdk import environment_tools
from sdk.exceptions import AuthenticationError, ServerFullError, ToolCallError, ToolTimeoutError
from sdk.openenv import OpenEnvEnvironment
from tests.envserver.servers import ProbeEnv, http_get, wait_until
from tests.sdk.openenv_side import run_openenv_client

OPENENV_CLIENTS = """
import json, sys
from openenv.core import GenericEnvClient
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.mcp_client import MCPToolClient

base, out = sys.argv[1], {}
with GenericEnvClient(base_url=base + "/openenv/counter").sync() as env:
    first = env.reset(target=2)
    out["reset"] = [first.observation, first.reward, first.done]
    step = env.step({"type": "call_tool", "tool_name": "increment", "arguments": {"step": 2}})
    out["step"] = [step.observation, step.reward, step.done]
    out["state"] = env.state()
    try:
        env.step({"foo": 1})
    except RuntimeError as exc:
        out["bad_action"] = str(exc)
with GenericEnvClient(base_url=base + "/openenv/gridworld").sync() as env:
    env.reset(seed=0)
    out["action_style"] = env.step({"action": "right"}).observation["result"]["data"]
with MCPToolClient(base_url=base + "/openenv/counter").sync() as env:
    out["tools"] = [[t.name, t.input_schema] for t in env.list_tools()]
    env.reset(target=3)
    out["call"] = env.call_tool("increment", step=3)
    out["reward"] = env.step(CallToolAction(tool_name="increment", arguments={"step": 0})).reward
    try:
        env.call_tool("increment", step="x")
    except RuntimeError as exc:
        out["call_error"] = str(exc)
print(json.dumps(out))
"""


def start(**config: Any) -> ServerThread:
    """counter, probe and gridworld (a ``step(action)`` tool) with test-friendly limits."""
    specs = {name: EnvSpec.from_factory(name, factory)
             for name, factory in (("counter", IncrementEnv), ("probe", ProbeEnv), ("gridworld", GridWorldEnv))}
    defaults: dict[str, Any] = {"port": 0, "call_timeout": 2.0, "drain_timeout": 0.2}
    return ServerThread(specs, ServerConfig(**{**defaults, **config})).start()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """One server for the module (tests leave no session open)."""
    thread = start()
    yield thread
    thread.stop()


def post(url: str, body: object, token: str | None = None) -> tuple[int, Any]:
    """(status, body) of a POST with a JSON body: the body decoded when it is JSON, else its text."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        text = exc.read()
        return exc.code, json.loads(text) if text.startswith(b"{") else text.decode()


@pytest.mark.slow
def test_openenvs_own_clients_drive_a_hosted_environment(server: ServerThread) -> None:
    out = json.loads(run_openenv_client(OPENENV_CLIENTS, server.url))
    assert out["reset"] == [{"prompt": "Increment the counter to 2.", "metadata": {}}, None, False]
    observation, reward, done = out["step"]
    assert observation["tool_name"] == "increment" and observation["result"]["data"] == "2"
    assert (reward, done) == (1.0, False)  # get_reward() after the call; toolgym environments have no done
    assert out["state"] == {"episode_id": None, "step_count": 1}
    assert "call-tool action" in out["bad_action"] and "VALIDATION_ERROR" in out["bad_action"]
    assert "Reward" in out["action_style"]  # {"action": ...} went to gridworld's step tool
    assert out["tools"] == [["increment", {"type": "object", "properties": {
        "step": {"type": "integer", "description": "Value to add to the counter."}}, "required": ["step"]}]]
    assert (out["call"], out["reward"]) == ("3", 1.0)
    assert "expected integer, got string" in out["call_error"]
    assert wait_until(lambda: len(server.table) == 0)  # every session ended with its client


def test_toolgyms_openenv_client_drives_the_face(server: ServerThread) -> None:
    async def episode() -> None:
        async with OpenEnvEnvironment(server.url + "/openenv/probe") as env:
            assert await env.reset(a=1) == 'probe {"a": 1}'
            assert {t.name for t in environment_tools(env)} == {"echo", "fail", "nap", "anap", "count"}
            assert await env.call("echo", {"text": "hi", "times": 2}) == "hihi"
            assert await env.get_reward() == 1.0  # ProbeEnv's reward: the calls of the episode
            with pytest.raises(ToolCallError, match="fail: ValueError: boom"):
                await env.call("fail", {"message": "boom"})
            with pytest.raises(ToolTimeoutError, match="nap: tool nap did not finish within 2 s"):
                await env.call("nap", {"seconds": 5})  # past the server's call_timeout (2 s)
            assert (await env.state())["step_count"] == 3

    asyncio.run(episode())


def test_error_frames_for_what_openenv_would_refuse(server: ServerThread) -> None:
    async def frames() -> list[dict[str, Any]]:
        replies = []
        async with connect(server.url.replace("http", "ws") + "/openenv/counter/ws") as ws:
            for text in ["{not json", json.dumps({"type": "teleport"}), json.dumps([1]),
                         json.dumps({"type": "step", "data": "x"}), json.dumps({"type": "reset"})]:
                await ws.send(text)
                replies.append(json.loads(await ws.recv()))
        return replies

    bad_json, unknown, not_object, bad_data, reset = asyncio.run(frames())
    assert (bad_json["type"], bad_json["data"]["code"]) == ("error", "INVALID_JSON")
    assert unknown["data"]["code"] == "UNKNOWN_TYPE" and "reset, step, state, mcp, close" in unknown["data"]["message"]
    assert not_object["data"]["code"] == "UNKNOWN_TYPE"
    assert bad_data["data"]["code"] == "VALIDATION_ERROR"
    assert reset["type"] == "observation"  # the session went on after each error


def test_limits_token_and_metrics_apply_to_the_face() -> None:
    thread = start(max_sessions=1, max_waiting=0, token="s3cret")
    try:
        async def sessions() -> None:
            async with OpenEnvEnvironment(thread.url + "/openenv/counter", token="s3cret") as first:
                await first.reset(target=1)
                assert await first.call("increment", {"step": 1}) == "1"
                with pytest.raises(ServerFullError, match="CAPACITY_REACHED"):
                    await OpenEnvEnvironment(thread.url + "/openenv/counter", token="s3cret").reset()
            with pytest.raises(AuthenticationError, match="HTTP 401"):
                await OpenEnvEnvironment(thread.url + "/openenv/counter", connect_timeout=1).reset()

        asyncio.run(sessions())
        assert http_get(thread.url + "/openenv/counter/health")[0] == 401
        metrics = http_get(thread.url + "/metrics", token="s3cret")[1].decode()
        assert 'toolgym_requests_total{env="counter",op="call",outcome="ok",tool="increment"} 1.0' in metrics
        assert 'toolgym_sessions_rejected_total{reason="server_full"} 1.0' in metrics
    finally:
        thread.stop()


def test_http_routes(server: ServerThread) -> None:
    base = server.url + "/openenv/counter"
    assert http_get(base + "/health") == (200, b'{"status":"healthy"}')
    assert json.loads(http_get(base + "/metadata")[1])["description"].startswith("A counter that starts at 0")
    assert json.loads(http_get(base + "/schema")[1])["action"]["properties"]["type"]["const"] == "call_tool"
    assert json.loads(http_get(base + "/state")[1]) == {"episode_id": None, "step_count": 0}
    status, body = http_get(server.url + "/openenv/countr/health")
    assert status == 404 and "did you mean 'counter'?" in json.loads(body)["detail"]
    first = {"observation": {"prompt": "Increment the counter to 4.", "metadata": {}}, "reward": None, "done": False}
    assert post(base + "/reset", {"target": 4}) == (200, first)
    status, body = post(base + "/step", {"action": {"type": "call_tool", "tool_name": "increment",
                                                    "arguments": {"step": 2}}})
    assert status == 200 and body["observation"]["result"]["data"] == "2"  # a fresh instance, as OpenEnv's
    status, body = post(base + "/mcp", {"jsonrpc": "2.0", "id": 7, "method": "tools/list"})
    assert body["id"] == 7 and body["result"]["tools"][0]["name"] == "increment"
    status, body = post(base + "/mcp", {"jsonrpc": "2.0", "id": 8, "method": "openenv/session/create"})
    session_id = body["result"]["session_id"]
    call = {"jsonrpc": "2.0", "id": 9, "method": "tools/call",
            "params": {"name": "increment", "arguments": {"step": 5}, "session_id": session_id}}
    assert post(base + "/mcp", call)[1]["result"]["data"] == "5"
    assert post(base + "/mcp", call)[1]["result"]["data"] == "10"  # the same session: the counter goes on
    close = {"jsonrpc": "2.0", "id": 10, "method": "openenv/session/close", "params": {"session_id": session_id}}
    assert post(base + "/mcp", close)[1]["result"]["closed"] is True
    assert "Unknown session_id" in post(base + "/mcp", call)[1]["error"]["message"]
    assert wait_until(lambda: len(server.table) == 0)


def test_request_bodies_are_bounded_in_size_and_time() -> None:
    thread = start(max_frame_bytes=1024, head_timeout=1.0)
    try:
        status, body = post(thread.url + "/openenv/counter/reset", {"pad": "x" * 2000})
        assert status == 413  # declared above max_frame_bytes: refused before a byte of it is read
        assert post(thread.url + "/health", {})[0] == 413  # our own routes still take no body
        with socket.create_connection(("127.0.0.1", thread.server.bound_port)) as sock:
            sock.sendall(b"POST /openenv/counter/reset HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            sock.settimeout(10)
            started = time.monotonic()
            assert sock.recv(1024) == b""  # dropped once the body is late, not held open
            assert time.monotonic() - started < 5
    finally:
        thread.stop()
