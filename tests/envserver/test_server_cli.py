"""``toolgym serve``: flags generated from ``ServerConfig``, spec errors with "did you mean", and a real
subprocess drained by SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import websockets

from envserver.cli import build_parser, main, parse_config
from envserver.config import ServerConfig
from envserver.exceptions import EnvSpecError
from envserver.registry import parse_specs
from sdk.exceptions import SpecNotFoundError


def test_every_config_field_is_a_flag_with_its_default_and_help(monkeypatch):
    monkeypatch.delenv("TOOLGYM_TOKEN", raising=False)
    assert parse_config(["counter"]) == (["counter"], ServerConfig(), "info")
    usage = " ".join(build_parser().format_help().split())
    for f in dataclasses.fields(ServerConfig):
        assert f"--{f.name}" in usage and " ".join(f.metadata["help"].split()) in usage


def test_flags_set_fields_and_the_token_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("TOOLGYM_TOKEN", "s3cret")
    specs, config, log_level = parse_config(
        ["counter", "wordle", "--port", "0", "--max-sessions", "4", "--inline_sync", "--log-level", "debug"])
    assert (specs, config, log_level) == (
        ["counter", "wordle"], ServerConfig(port=0, token="s3cret", max_sessions=4, inline_sync=True), "debug")
    assert parse_config(["counter", "--token", "other"])[1].token == "other"


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


def test_env_kwargs_make_every_session_of_a_hosted_name_with_them(capsys):
    specs = parse_specs(["counter", "wordle"], {"counter": {"max_target": 2}})
    assert specs["counter"].factory().max_target == 2 and specs["wordle"].factory().max_guesses == 6
    for argv, message in [
        (["counter", "--env_kwargs", '{"counter": {"high": 1}}'],
         "IncrementEnv cannot be made with {'high': 1}: got an unexpected keyword argument 'high'"),
        (["counter", "--env_kwargs", '{"wordle": {}}'], "--env_kwargs names ['wordle'], which this server does not"),
        (["counter", "--env_kwargs", "not json"], "--env_kwargs must be a JSON object"),
    ]:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
