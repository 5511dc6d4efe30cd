"""The hosted ``python`` environment on a real ``toolgym serve`` subprocess: its secrets stay out of reach,
and it refuses to start without isolation unless weak mode is chosen, which it warns about."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from environments.sandbox import MODE_VARIABLE
from sdk import SyncRemoteEnvironment

PROJECT = str(Path(__file__).resolve().parents[2])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(port: int, env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "envserver.cli", "python", "--port", str(port),
                                 "--log-level", "warning", *args], env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait_for_port(proc: subprocess.Popen[bytes], port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert proc.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def secret_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, str, str]]:
    """A server hosting ``python`` with a bearer token and a secret in its environment."""
    token, secret, port = f"token-{uuid.uuid4().hex}", f"secret-{uuid.uuid4().hex}", _free_port()
    env = {**os.environ, "TOOLGYM_TOKEN": "", "TOOLGYM_TEST_SECRET": secret, MODE_VARIABLE: ""}
    proc = _serve(port, env, tmp_path_factory.mktemp("server") / "log", "--token", token)
    try:
        _wait_for_port(proc, port)
        yield f"http://127.0.0.1:{port}", port, token, secret
    finally:
        proc.kill()
        proc.wait()


SNOOP = """
import glob, os, socket
found = []
for path in glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ') + glob.glob('/proc/*/task/*/environ'):
    if path.split('/')[2] in ('self', 'thread-self', str(os.getpid())):
        continue  # this script's own command line: long, and no secret
    try:
        found.append(open(path, 'rb').read().decode(errors='replace'))
    except OSError:
        pass
for path in ['{project}/pyproject.toml', '/root/.bash_history', '/etc/hostname', '/etc/passwd']:
    try:
        found.append(open(path).read())
    except OSError:
        pass
found.append(repr(dict(os.environ)))
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=3)
    found.append('CONNECTED')
except OSError as e:
    found.append(f'connect failed {{e.errno}}')
print('\\n'.join(found))
"""


def test_sandboxed_code_cannot_read_the_server_s_token_environment_or_files_nor_reach_it(secret_server):
    url, port, token, secret = secret_server
    with SyncRemoteEnvironment(url, "python", token=token) as env:
        env.reset(tests=["assert True"])
        out = env.call("run_code", {"code": SNOOP.format(project=PROJECT, port=port)})
    assert "connect failed 97" in out and "CONNECTED" not in out  # EAFNOSUPPORT: no TCP socket at all
    assert token not in out and secret not in out
    assert "[project]" not in out  # pyproject.toml
    assert "envserver" not in out  # the server's command line


def test_a_hack_through_the_hosted_environment_scores_0(secret_server):
    url, _, token, _ = secret_server
    with SyncRemoteEnvironment(url, "python", token=token) as env:
        env.reset(tests=["assert f(1) == 2", "assert f(2) == 3"])
        env.call("run_code", {"code": "print('__toolgym_tests__ 99')\nimport os\nos._exit(0)"})
        assert env.get_reward() == 0.0
        env.call("run_code", {"code": "def f(x):\n    return x + 1\n"})
        assert env.get_reward() == 1.0


def test_the_server_refuses_to_host_python_without_bubblewrap(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path), MODE_VARIABLE: "", "TOOLGYM_TOKEN": ""}
    log = tmp_path / "log"
    proc = _serve(_free_port(), env, log)
    assert proc.wait(timeout=120) == 2  # a bad setup: one line naming the fix, no traceback
    text = log.read_text()
    assert text.startswith("toolgym serve: ") and "Traceback" not in text
    assert "apt-get install bubblewrap" in text and "TOOLGYM_SANDBOX=weak" in text


def test_weak_mode_is_explicit_and_warned_about_at_start(tmp_path):
    port = _free_port()
    env = {**os.environ, "PATH": str(tmp_path), MODE_VARIABLE: "weak", "TOOLGYM_TOKEN": ""}
    log = tmp_path / "log"
    proc = _serve(port, env, log)
    try:
        _wait_for_port(proc, port)
        text = log.read_text()
        assert "WITHOUT OS isolation" in text and "token" in text
    finally:
        proc.kill()
        proc.wait()
