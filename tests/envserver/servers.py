"""Test environments and env server fixtures, shared by every test folder.

The root ``tests/conftest.py`` registers this module as a plugin, so its fixtures are available
everywhere; its helpers are imported as ``from tests.envserver.servers import ...``. Servers run
in-process on a free loopback port (``envserver.ServerThread``).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from environments.counter import IncrementEnv
from envserver import EnvSpec, ServerConfig, ServerThread

__all__ = [
    "NoRewardEnv",
    "ProbeEnv",
    "health",
    "http_get",
    "make_server",
    "request",
    "server",
    "wait_until",
    "ws_url",
]


class ProbeEnv:
    """A test environment whose tools succeed, fail, block or sleep on demand."""

    def __init__(self) -> None:
        self.calls = 0
        self.log: list[str] = []

    def reset(self, **kwargs: Any) -> str:
        """Start an episode; echoes the kwargs it got."""
        self.log = []
        return "probe " + json.dumps(kwargs, sort_keys=True)

    def get_reward(self) -> float:
        """The number of tool calls in the episode."""
        return float(len(self.log))

    def echo(self, text: str, times: int = 1) -> str:
        """Echo text.

        Args:
            text: What to echo.
            times: How many times.
        """
        self.calls += 1
        self.log.append(text)
        return text * times

    def fail(self, message: str) -> str:
        """Raise ValueError.

        Args:
            message: The error message.
        """
        raise ValueError(message)

    def nap(self, seconds: float) -> str:
        """Sleep in a thread (a slow sync tool; with 0 a cheap one).

        Args:
            seconds: How long.
        """
        if seconds > 0:
            time.sleep(seconds)
        self.calls += 1
        self.log.append("nap")
        return "rested"

    async def anap(self, seconds: float) -> str:
        """Sleep on the loop (a slow async tool).

        Args:
            seconds: How long.
        """
        await asyncio.sleep(seconds)
        self.log.append("anap")
        return "rested"

    def count(self) -> int:
        """How many echo/nap calls this instance has run since it was made."""
        return self.calls


class NoRewardEnv:
    """An environment without get_reward, whose reset returns None."""

    def reset(self, **kwargs: Any) -> None:
        """Start an episode."""

    def ping(self) -> str:
        """Answer pong."""
        return "pong"


async def request(ws: Any, rid: int, op: str, **fields: Any) -> dict[str, Any]:
    """Send one request frame on a raw WebSocket and return the decoded reply."""
    await ws.send(json.dumps({"id": rid, "op": op, **fields}))
    return json.loads(await ws.recv())


def make_server(**config: Any) -> ServerThread:
    """A started server hosting counter, probe and noreward with test-friendly limits."""
    specs = {name: EnvSpec.from_factory(name, factory)
             for name, factory in (("counter", IncrementEnv), ("probe", ProbeEnv), ("noreward", NoRewardEnv))}
    defaults: dict[str, Any] = {"port": 0, "call_timeout": 2.0, "drain_timeout": 0.2, "resume_grace": 5.0}
    return ServerThread(specs, ServerConfig(**{**defaults, **config})).start()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    """One shared server with default limits (tests must leave no session open)."""
    thread = make_server()
    yield thread
    thread.stop()


def ws_url(server: ServerThread, env: str, query: str = "v=1") -> str:
    """The WebSocket URL of ``env`` on ``server``."""
    return server.url.replace("http://", "ws://") + f"/v1/ws/{env}?{query}"


def http_get(url: str, token: str | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET, without raising on HTTP errors."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def health(server: ServerThread) -> dict[str, Any]:
    """The server's /health body."""
    return json.loads(http_get(server.url + "/health")[1])


def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until true or ``timeout``; returns its last value."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
