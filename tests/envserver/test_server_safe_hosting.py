"""Safe hosting by default: a host beyond loopback needs a token or an explicit ``--no_auth`` (warned at
every start), and an empty token is an error, never "auth off"."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from envserver.cli import main, parse_config
from envserver.config import ServerConfig
from envserver.exceptions import ServerConfigError

REFUSED = "listens beyond this machine and no token is set"


@pytest.fixture(autouse=True)
def _no_token_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOOLGYM_TOKEN", raising=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "myhost.example"])
def test_a_host_beyond_loopback_without_a_token_is_refused(host: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ServerConfigError, match=REFUSED):
        ServerConfig(host=host)
    assert main(["counter", "--host", host]) == 2
    assert REFUSED in capsys.readouterr().err
    assert ServerConfig(host=host, token="s3cret").token == "s3cret"
    assert ServerConfig(host=host, no_auth=True).no_auth


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_needs_no_token(host: str) -> None:
    assert ServerConfig(host=host).loopback_only


def test_an_empty_token_is_an_error_not_auth_off(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # The foot-gun: toolgym serve ... --token "$SECRET" with SECRET unset.
    assert main(["counter", "--host", "0.0.0.0", "--token", ""]) == 2
    assert "token must be non-empty" in capsys.readouterr().err
    with pytest.raises(ServerConfigError, match="token must be non-empty"):
        parse_config(["counter", "--token", ""])
    monkeypatch.setenv("TOOLGYM_TOKEN", "from-env")
    assert parse_config(["counter", "--host", "0.0.0.0"])[1].token == "from-env"
    with pytest.raises(ServerConfigError, match="contradict"):
        ServerConfig(token="s3cret", no_auth=True)


def test_no_auth_serves_and_warns_at_start() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "envserver.cli", "counter", "--host", "0.0.0.0", "--port", "0",
                             "--no_auth"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        lines: list[str] = []
        while time.monotonic() < deadline and proc.poll() is None:
            lines.append(proc.stderr.readline())
            if "--no_auth:" in lines[-1]:
                break
        assert "accepts every client without a token" in lines[-1], "".join(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
