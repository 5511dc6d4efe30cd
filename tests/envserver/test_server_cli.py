"""``toolgym serve``: spec errors with "did you mean", and a real subprocess drained by SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import websockets

from envserver.cli import main
from envserver.exceptions import EnvSpecError
from envserver.registry import parse_specs
from sdk.exceptions import SpecNotFoundError


@pytest.mark.parametrize(("spec", "hint"), [
    ("countr", "did you mean 'counter'"),
    ("environments.countr:IncrementEnv", "did you mean 'counter'"),
    ("environments.counter:IncrementEnvv", "did you mean 'IncrementEnv'"),
    ("nosuchpackage_xyz:Env", "no module named 'nosuchpackage_xyz'"),
])
def test_bad_spec_exits_2_with_a_hint(capsys, spec, hint):
    assert main([spec]) == 2
    assert hint in capsys.readouterr().err


def test_specs_name_environments_and_refuse_duplicates():
    specs = parse_specs(["counter", "inc=environments.counter:IncrementEnv", "environments.wordle:WordGuessEnv"])
    assert list(specs) == ["counter", "inc", "WordGuessEnv"]
    assert list(specs["WordGuessEnv"].tools) == ["guess"]
    with pytest.raises(EnvSpecError, match="two environments are named 'counter'"):
        parse_specs(["counter", "counter=environments.wordle:WordGuessEnv"])
    with pytest.raises(SpecNotFoundError):
        parse_specs(["environments.counter:Nope"])


@pytest.mark.parametrize(("args", "message"), [
    (["--max-sessions", "0"], "max_sessions must be >= 1"),
    (["--inline-threshold", "-1"], "inline_threshold must be >= 0"),
    (["--max_head_bytes", "0"], "max_head_bytes must be >= 1"),
    (["--head_timeout", "0"], "head_timeout must be > 0"),
    (["--max_buffered_bytes", "0"], "max_buffered_bytes must be >= 1"),
    (["--fragment_timeout", "-1"], "fragment_timeout must be > 0"),
])
def test_bad_config_exits_2(capsys, args, message):
    assert main(["counter", *args]) == 2
    assert message in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_drains_then_exits():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "envserver.cli", "counter", "--port", str(port), "--drain-timeout", "5",
         "--log-level", "warning"],
        env={**os.environ, "TOOLGYM_TOKEN": ""},
    )
    url = f"ws://127.0.0.1:{port}/v1/ws/counter?v=1"

    async def rpc(ws, rid, op, **fields):
        await ws.send(json.dumps({"id": rid, "op": op, **fields}))
        return json.loads(await ws.recv())

    async def scenario():
        deadline = time.monotonic() + 30
        while True:
            try:
                ws = await websockets.connect(url)
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not start"
                await asyncio.sleep(0.1)
        await ws.recv()
        await rpc(ws, 1, "reset", kwargs={"target": 1})
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        call = await rpc(ws, 2, "call", tool="increment", args={"step": 1})  # the episode may finish
        reset = await rpc(ws, 3, "reset")  # but no new episode starts here
        async with websockets.connect(url) as newcomer:
            refused = json.loads(await newcomer.recv())
        closing = time.monotonic()
        await rpc(ws, 4, "close")
        await ws.close()
        return call, reset, refused, closing

    try:
        call, reset, refused, closing = asyncio.run(scenario())
        assert call["result"] == "1"
        assert reset["error"]["code"] == "server_draining"
        assert refused["op"] == "bye" and refused["error"]["code"] == "server_draining"
        proc.wait(timeout=10)
        assert time.monotonic() - closing < 4  # exits once the last session closed, before drain_timeout
    finally:
        proc.kill()
        proc.wait()
