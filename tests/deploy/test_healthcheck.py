"""``deploy/envserver/healthcheck.py``, the image's HEALTHCHECK and the readiness probe, run as they run
it (a process, the token from ``TOOLGYM_TOKEN``) against a real env server on loopback."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from envserver import ServerThread
from sdk import RemoteEnvironment
from tests.doc_blocks import ROOT
from tests.envserver.servers import make_server

SCRIPT = ROOT / "deploy" / "envserver" / "healthcheck.py"
TOKEN = "probe-token"


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerThread]:
    """A server that wants ``TOKEN`` on every route, /health included."""
    thread = make_server(token=TOKEN)
    yield thread
    thread.stop()


def _probe(url: str, token: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TOOLGYM_TOKEN"}
    if token is not None:
        env["TOOLGYM_TOKEN"] = token
    return subprocess.run([sys.executable, str(SCRIPT), "--url", url, "--timeout", "5"],
                          capture_output=True, text=True, timeout=60, env=env)


def test_a_ready_server_with_the_right_token_passes(guarded: ServerThread) -> None:
    result = _probe(guarded.url, TOKEN)
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_missing_or_wrong_token_fails_with_401(guarded: ServerThread, token: str | None) -> None:
    result = _probe(guarded.url, token)
    assert result.returncode == 1
    assert result.stderr.strip() == f"{guarded.url}/health: HTTP 401"


def test_a_full_server_is_not_ready() -> None:
    thread = make_server(max_sessions=1, max_waiting=0)
    url = thread.url

    async def probe_while_full() -> subprocess.CompletedProcess[str]:
        async with RemoteEnvironment(url, "counter") as env:
            await env.reset()  # the one session there is room for
            return await asyncio.to_thread(_probe, url, None)

    try:
        before = _probe(url, None)
        full = asyncio.run(probe_while_full())
    finally:
        thread.stop()
    assert before.returncode == 0
    assert (full.returncode, full.stderr.strip()) == (1, f"{url}/health: HTTP 503")


def test_nothing_listening_fails_as_unreachable() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and has nobody behind it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = _probe(f"http://127.0.0.1:{port}", TOKEN)
    assert result.returncode == 1
    assert "unreachable" in result.stderr
