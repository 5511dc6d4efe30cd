"""The OpenEnv side of the interop tests: OpenEnv 0.10's own servers and client, in their own venv.

OpenEnv 0.10 needs fastmcp 3, which needs ``mcp<2``; vLLM 0.32 needs ``mcp>=2``: the two cannot share a
venv. ``make setup`` makes ``.cache/openenv/venv`` with the ``openenv`` extra's pin
(``scripts/setup.sh``); ``TOOLGYM_OPENENV_PYTHON`` names another interpreter. Tests start OpenEnv
servers and run OpenEnv's client there, as subprocesses, and talk to them over loopback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def openenv_python() -> str:
    """The OpenEnv venv's interpreter; fails the test with the command that makes it when missing."""
    python = os.environ.get("TOOLGYM_OPENENV_PYTHON") or str(ROOT / ".cache" / "openenv" / "venv" / "bin" / "python")
    if not Path(python).exists():
        pytest.fail(f"the OpenEnv venv is missing ({python}): run `make setup`, which makes it")
    return python


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_health(url: str, process: subprocess.Popen[bytes] | None = None, timeout: float = 120.0) -> None:
    """Wait until ``url``/health answers 200 (OpenEnv imports for ~10 s on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:  # noqa: S310 (loopback)
                if response.status == 200:
                    return
        except OSError:
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {url} did not answer /health within {timeout:g} s")
        time.sleep(0.2)


@contextmanager
def openenv_servers(*commands: Sequence[str]) -> Iterator[list[str]]:
    """Run OpenEnv server scripts (each ``[script, *args]``; ``--port`` added) with the OpenEnv venv, all
    at once (each imports OpenEnv for seconds); yields their base URLs once all answer ``/health``."""
    python = openenv_python()
    ports = [free_port() for _ in commands]
    processes = [subprocess.Popen([python, *map(str, command), "--port", str(port)], cwd=ROOT)
                 for command, port in zip(commands, ports, strict=True)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url, process in zip(urls, processes, strict=True):
            wait_for_health(url, process)
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_openenv_client(code: str, *args: str, timeout: float = 120.0) -> str:
    """Run ``code`` (a script using OpenEnv's client; ``sys.argv[1:]`` are ``args``) with the OpenEnv
    venv's python and return its stdout; a failing script fails the test with its stderr."""
    done = subprocess.run([openenv_python(), "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    if done.returncode != 0:
        pytest.fail(f"OpenEnv's client failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def servers_script() -> Path:
    """``tests/sdk/openenv_servers.py``: the test environments in OpenEnv's shape."""
    return HERE / "openenv_servers.py"
