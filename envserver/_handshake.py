"""The server's half of the WebSocket opening handshake (RFC 6455 section 4.2), over bytes.

``read_upgrade`` checks an upgrade request's head and gives what the handshake needs, or the HTTP
refusal to send instead; ``upgrade_scope`` builds the ASGI scope uvicorn's own WebSocket protocols
would give the app; ``accept_response`` is the ``101`` answer. ``WebSocketProtocol`` does the rest.
"""

from __future__ import annotations

import binascii
import hashlib
from typing import Any, NamedTuple
from urllib.parse import unquote

from uvicorn.config import Config

__all__ = ["Refusal", "Upgrade", "accept_response", "read_upgrade", "upgrade_scope"]

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3


class Upgrade(NamedTuple):
    """A valid upgrade request: its target, headers (lower-case names, in order) and the accept key."""

    target: bytes
    headers: list[tuple[bytes, bytes]]
    fields: dict[bytes, bytes]  # the same headers by name, repeated ones joined with ", "
    accept_key: bytes


class Refusal(NamedTuple):
    """The HTTP answer to an upgrade request that is not a valid handshake."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]


def read_upgrade(head: bytes) -> Upgrade | Refusal:
    """Check a request head (without its final blank line) as a version-13 WebSocket handshake."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    headers = []
    fields: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        headers.append((name, value))
        fields[name] = fields[name] + b", " + value if name in fields else value
    if len(parts) != 3 or parts[0] != b"GET" or parts[2] != b"HTTP/1.1":
        return Refusal(400, b"a WebSocket handshake is a GET request over HTTP/1.1", [])
    if fields.get(b"upgrade", b"").lower() != b"websocket" or b"upgrade" not in [
            token.strip() for token in fields.get(b"connection", b"").lower().split(b",")]:
        return Refusal(400, b"missing 'Upgrade: websocket' or 'Connection: Upgrade'", [])
    if fields.get(b"sec-websocket-version") != b"13":
        return Refusal(426, b"unsupported WebSocket version; this server speaks 13",
                       [(b"sec-websocket-version", b"13")])
    key = fields.get(b"sec-websocket-key", b"")
    try:
        valid_key = len(binascii.a2b_base64(key, strict_mode=True)) == 16
    except binascii.Error:
        valid_key = False
    if not valid_key:
        return Refusal(400, b"missing or malformed Sec-WebSocket-Key", [])
    accept_key = binascii.b2a_base64(hashlib.sha1(key + _GUID).digest(), newline=False)
    return Upgrade(parts[1], headers, fields, accept_key)


def upgrade_scope(upgrade: Upgrade, config: Config, addresses: tuple[Any, Any, str],
                  app_state: dict[str, Any]) -> dict[str, Any]:
    """The ASGI ``websocket`` scope of ``upgrade``; ``addresses`` are (server, client, scheme)."""
    raw_path, _, query = upgrade.target.partition(b"?")
    path = raw_path.decode("latin-1")
    root = config.root_path
    server, client, scheme = addresses
    subprotocols = upgrade.fields.get(b"sec-websocket-protocol")
    return {
        "type": "websocket",
        "asgi": {"version": config.asgi_version, "spec_version": "2.4"},
        "http_version": "1.1",
        "scheme": scheme,
        "server": server,
        "client": client,
        "root_path": root,
        "path": root + (unquote(path) if "%" in path else path),
        "raw_path": root.encode() + raw_path,
        "query_string": query,
        "headers": upgrade.headers,
        "subprotocols": [p.strip() for p in subprotocols.decode("latin-1").split(",")] if subprotocols else [],
        "state": app_state.copy(),
        "extensions": {"websocket.http.response": {}},
    }


def accept_response(accept_key: bytes, headers: list[tuple[bytes, bytes]], subprotocol: str | None) -> bytes:
    """The ``101 Switching Protocols`` answer, with ``headers`` and the subprotocol the app chose."""
    head = [b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            b"sec-websocket-accept: ", accept_key, b"\r\n"]
    for name, value in headers:
        head += [name, b": ", value, b"\r\n"]
    if subprotocol:
        head += [b"sec-websocket-protocol: ", subprotocol.encode(), b"\r\n"]
    head.append(b"\r\n")
    return b"".join(head)
