"""The env server as a streamable-HTTP MCP server (``/mcp/NAME``), driven by the ``mcp`` package's client.

An MCP session is an environment session: its state lives across calls, it counts against
``max_sessions``, it ends when the client closes; the token and the metrics apply. toolgym's own
``MCPEnvironment`` drives it too (MCP both ways at once).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from envserver import ServerThread
from sdk import environment_tools
from sdk.exceptions import ServerUnavailableError, ToolCallError
from sdk.mcp import MCPEnvironment
from tests.envserver.servers import http_get, make_server, wait_until


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """counter, probe and noreward; tests leave no session open."""
    thread = make_server()
    yield thread
    thread.stop()


def request(url: str, method: str, body: object = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, decoded JSON body or None) of one HTTP request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            text = response.read()
            return response.status, json.loads(text) if text else None
    except urllib.error.HTTPError as exc:
        text = exc.read()
        return exc.code, json.loads(text) if text else None


def test_an_mcp_client_drives_a_hosted_environment(server: ServerThread) -> None:
    async def session() -> None:
        async with Client(server.url + "/mcp/probe") as client:  # mode "auto": probes, then the handshake
            assert client.server_info is not None and client.server_info.name == "toolgym/probe"
            assert len(server.table) == 1  # the MCP session is an environment session
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) == {"echo", "fail", "nap", "anap", "count"}
            assert tools["echo"].input_schema["required"] == ["text"]
            result = await client.call_tool("echo", {"text": "hi", "times": 3})
            assert (result.content[0].text, result.is_error) == ("hihi" "hi", False)
            assert (await client.call_tool("count", {})).content[0].text == "1"  # the same instance
            failed = await client.call_tool("fail", {"message": "boom"})
            assert failed.is_error and failed.content[0].text == "ValueError: boom"
            invalid = await client.call_tool("echo", {"text": 5})
            assert invalid.is_error and "text: expected string, got integer" in invalid.content[0].text
            with pytest.raises(MCPError, match="unknown tool 'nope'"):
                await client.call_tool("nope", {})

    asyncio.run(session())
    assert wait_until(lambda: len(server.table) == 0)  # closing the client ended the session
    metrics = http_get(server.url + "/metrics")[1].decode()
    assert 'toolgym_requests_total{env="probe",op="call",outcome="ok",tool="echo"}' in metrics


def test_toolgyms_mcp_client_drives_the_face(server: ServerThread) -> None:
    async def episode() -> None:
        async with MCPEnvironment(server.url + "/mcp/counter") as env:
            await env.reset()
            assert [t.name for t in environment_tools(env)] == ["increment"]
            assert await env.call("increment", {"step": 2}) == "2"
            with pytest.raises(ToolCallError, match="increment: step: expected integer"):
                await env.call("increment", {"step": "x"})

    asyncio.run(episode())
    assert wait_until(lambda: len(server.table) == 0)


def test_sessions_ids_methods_and_names(server: ServerThread) -> None:
    url = server.url + "/mcp/counter"
    status, body = request(url, "POST", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert status == 400 and "send initialize first" in body["error"]["message"]
    status, body = request(url, "POST", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                           {"Mcp-Session-Id": "not-a-session"})
    assert status == 404 and "initialize again" in body["error"]["message"]
    assert request(url, "GET")[0] == 405
    status, body = request(server.url + "/mcp/countr", "POST", {"jsonrpc": "2.0", "id": 1, "method": "initialize"})
    assert status == 404 and "did you mean 'counter'?" in body["error"]["message"]


def test_limits_and_token_apply() -> None:
    thread = make_server(max_sessions=1, max_waiting=0, token="s3cret")
    url = thread.url + "/mcp/counter"

    def client(token: str | None) -> Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return Client(streamable_http_client(url, http_client=create_mcp_http_client(headers=headers)),
                      mode="legacy")

    async def sessions() -> None:
        async with client("s3cret") as first:
            assert (await first.call_tool("increment", {"step": 1})).content[0].text == "1"
            second = MCPEnvironment(url, headers={"Authorization": "Bearer s3cret"}, connect_timeout=5)
            with pytest.raises(ServerUnavailableError, match="server full"):  # the one slot is taken
                await second.reset()
        with pytest.raises(ServerUnavailableError, match="could not start or reach MCP server"):
            await MCPEnvironment(url, connect_timeout=5).reset()  # no token

    try:
        asyncio.run(sessions())
        assert wait_until(lambda: len(thread.table) == 0)
    finally:
        thread.stop()
