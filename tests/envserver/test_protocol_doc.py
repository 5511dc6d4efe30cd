"""docs/protocol.md names everything the server can put on the wire: error codes, close codes, statuses, limits."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from envserver import _websocket, _wire
from envserver.config import ServerConfig
from sdk.protocol import CLOSE_SESSION_ENDED, ErrorCode

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
SOURCE = Path(_websocket.__file__).read_text()


def documented(value: object) -> bool:
    return f"`{value}`" in DOC


@pytest.mark.parametrize("code", [code.value for code in ErrorCode])
def test_every_error_code_is_documented(code):
    assert documented(code), f"error code {code!r} is not in docs/protocol.md"


def test_every_close_code_the_server_sends_is_documented():
    sent = {int(code) for code in re.findall(r"(?:_fail|_fail_now|close_frame|_send_close)\((\d{4})", SOURCE)}
    assert {1002, 1007, 1008, 1009, 1011, 1012} <= sent  # the scan finds them
    missing = sorted(code for code in sent | {CLOSE_SESSION_ENDED} if not documented(code))
    assert not missing, f"close codes not in docs/protocol.md: {missing}"


def test_every_http_status_the_server_answers_is_documented():
    missing = sorted(status for status in _wire.HTTP_REASONS if not documented(status))
    assert not missing, f"HTTP statuses not in docs/protocol.md: {missing}"


@pytest.mark.parametrize("name", [field.name for field in dataclasses.fields(ServerConfig)
                                  if field.name not in ("host", "port", "token", "inline_sync", "inline_threshold")])
def test_every_limit_is_documented(name):
    assert documented(name), f"ServerConfig.{name} is not in docs/protocol.md"
