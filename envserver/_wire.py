"""Bytes both of the server's own protocols put on the wire, and the limits they read.

Server WebSocket frames (unmasked), the close frame, HTTP responses that end a connection before
any route runs, the masking function for client frames, and ``limits_of``: the ``ServerConfig``
a uvicorn config carries (``EnvServer`` sets it), or the defaults.
"""

from __future__ import annotations

import codecs

from uvicorn.config import Config

from envserver.config import ServerConfig

__all__ = ["HTTP_REASONS", "VALID_CLOSE", "apply_mask", "close_frame", "frame", "http_response", "limits_of",
           "utf8_decoder"]

try:
    from websockets.speedups import apply_mask  # C; ~0.5 us for a small frame
except ImportError:  # pragma: no cover (websockets built without its C extension)
    def apply_mask(data: bytes | bytearray | memoryview[int], mask: bytes | bytearray) -> bytes:
        n = len(data)
        key = (mask * (n // 4 + 1))[:n]
        return (int.from_bytes(data, "little") ^ int.from_bytes(key, "little")).to_bytes(n, "little")

# Close codes a peer may put on the wire (RFC 6455 section 7.4): 1004-1006 and 1015 are reserved.
VALID_CLOSE = frozenset((1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014))
HTTP_REASONS = {400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 413: b"Content Too Large",
                426: b"Upgrade Required", 429: b"Too Many Requests", 431: b"Request Header Fields Too Large",
                500: b"Internal Server Error"}
_DEFAULT_LIMITS = ServerConfig()


def frame(first: int, payload: bytes) -> bytes:
    """One unmasked server frame: ``first`` is FIN plus the opcode."""
    n = len(payload)
    if n < 126:
        return bytes((first, n)) + payload
    if n < 1 << 16:
        return bytes((first, 126)) + n.to_bytes(2, "big") + payload
    return bytes((first, 127)) + n.to_bytes(8, "big") + payload


def close_frame(code: int, reason: str = "") -> bytes:
    """A close frame with ``code`` and as much of ``reason`` as fits (whole UTF-8 characters)."""
    text = reason.encode()[:123].decode(errors="ignore").encode()  # a control frame carries 125 bytes at most
    return frame(0x88, code.to_bytes(2, "big") + text)  # FIN and the close opcode


def limits_of(config: Config) -> ServerConfig:
    """The env server settings a uvicorn config carries (``EnvServer`` sets ``env_config``), else the defaults."""
    return getattr(config, "env_config", None) or _DEFAULT_LIMITS


def http_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """An HTTP/1.1 response that closes the connection (plain text unless ``headers`` say otherwise)."""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, HTTP_REASONS.get(status, b""))]
    lines += [name + b": " + value + b"\r\n" for name, value in headers]
    names = {name.lower() for name, _ in headers}
    if b"content-length" not in names:
        lines.append(b"content-length: %d\r\n" % len(body))
    if b"content-type" not in names:
        lines.append(b"content-type: text/plain; charset=utf-8\r\n")
    lines += [b"connection: close\r\n\r\n", body]
    return b"".join(lines)


def utf8_decoder() -> codecs.IncrementalDecoder:
    """A decoder that checks UTF-8 piece by piece (a fragmented text message, one fragment at a time)."""
    return codecs.getincrementaldecoder("utf-8")()
