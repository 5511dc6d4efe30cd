"""``EnvServerProcess``: a real env server child process, ready when it says so, gone when stopped."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from trainer.exceptions import EnvServerLaunchError
from trainer.launch.envserver import EnvServerProcess


def test_the_server_is_healthy_when_started_and_gone_when_stopped() -> None:
    with EnvServerProcess(["counter"], quiet=True) as server:
        with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:
            assert json.load(response)["sessions"] == 0
        assert server.alive()
    assert not server.alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{server.url}/health", timeout=2)


def test_a_server_that_cannot_start_is_reported_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(EnvServerLaunchError, match=r"no_such_module:Env exited with code 2 before it was ready"):
        EnvServerProcess(["no_such_module:Env"], quiet=True, ready_timeout_s=120).start()
    assert time.monotonic() - t0 < 60  # the process's exit ends the wait, not the timeout
