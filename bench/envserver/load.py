"""Load generator for bench/envserver: one client, two wire protocols (toolgym and OpenEnv).

Both servers get exactly the same client: a minimal WebSocket client on a plain asyncio protocol
(below), one connection per session, closed-loop requests; only the frames differ. It does the
least a client can: a fixed handshake request, unfragmented text frames masked with an all-zero
key (legal, and it makes masking a no-op), no extensions. An earlier version used aiohttp's
client, which spent about 0.4 ms of the client's single core per connection: with 1,024 sessions
opening at once the client alone took 0.4 s, more than the open time being measured.
Run by ``run.py`` in a subprocess; prints one JSON object (the last line; a calls phase prints
``measuring`` and ``stopped`` before it, when its measured window starts and ends)::

    python bench/envserver/load.py calls toolgym http://127.0.0.1:8765 1024 5
    python bench/envserver/load.py churn openenv http://127.0.0.1:8766 32 5
"""

from __future__ import annotations

import asyncio
import collections
import json
import statistics
import sys
import time
import urllib.parse
from typing import Any

# A fixed key is fine for a benchmark (servers only echo its hash); its accept value per RFC 6455.
_KEY = b"dGhlIHNhbXBsZSBub25jZQ=="
_ACCEPT = b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
_ZERO_MASK = b"\x00\x00\x00\x00"
_CLOSE_FRAME = b"\x88\x82" + _ZERO_MASK + (1000).to_bytes(2, "big")


def _frame(opcode: int, payload: bytes) -> bytes:
    """A final, masked client frame (the all-zero mask leaves the payload as it is)."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + n.to_bytes(8, "big")
    return head + _ZERO_MASK + payload


class WebSocket(asyncio.Protocol):
    """One client WebSocket: ``await recv()`` gives the next text message, ``None`` once closed."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.upgraded = False
        self.messages: collections.deque[str | None] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.close_sent = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        if not self.upgraded:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end])
            del buffer[:end + 4]
            if not head.startswith(b"HTTP/1.1 101") or _ACCEPT not in head:
                self._push(None)
                return
            self.upgraded = True
            self._push("")  # the handshake is done
        while len(buffer) >= 2:
            opcode, n, start = buffer[0] & 0x0F, buffer[1] & 0x7F, 2
            if n == 126:
                n, start = int.from_bytes(buffer[2:4], "big"), 4
            elif n == 127:
                n, start = int.from_bytes(buffer[2:10], "big"), 10
            if len(buffer) < start + n:
                return
            payload = bytes(buffer[start:start + n])
            del buffer[:start + n]
            if opcode == 0x1:
                self._push(payload.decode())
            elif opcode == 0x9:
                self.transport.write(_frame(0xA, payload))  # type: ignore[union-attr]
            elif opcode == 0x8:
                if not self.close_sent:  # answer the server's close, as the RFC asks
                    self.close_sent = True
                    self.transport.write(_CLOSE_FRAME)  # type: ignore[union-attr]
                self._push(None)
            elif opcode != 0xA:
                raise RuntimeError(f"unexpected frame opcode {opcode} (fragmented or binary)")

    def connection_lost(self, exc: Exception | None) -> None:
        self._push(None)

    def _push(self, message: str | None) -> None:
        if message is None:
            if self.closed:
                return
            self.closed = True
        self.messages.append(message)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def recv(self) -> str | None:
        """The next text message; ``None`` when the connection ended."""
        while not self.messages:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.messages.popleft()

    def send(self, text: str) -> None:
        """Send one text message."""
        self.transport.write(_frame(0x1, text.encode()))  # type: ignore[union-attr]

    async def close(self) -> None:
        """Close handshake: send a close frame, wait for the server's close (or EOF), drop the TCP."""
        if not self.closed:
            self.close_sent = True
            self.transport.write(_CLOSE_FRAME)  # type: ignore[union-attr]
            while await self.recv() is not None:
                pass
        self.transport.close()  # type: ignore[union-attr]


class Client:
    """Opens the WebSocket connections of one load process to one URL."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        target = parts.path + ("?" + parts.query if parts.query else "")
        self.request = (f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
                        f"Connection: Upgrade\r\nSec-WebSocket-Key: {_KEY.decode()}\r\n"
                        f"Sec-WebSocket-Version: 13\r\n\r\n").encode()

    async def connect(self) -> WebSocket:
        _, ws = await asyncio.get_running_loop().create_connection(
            lambda: WebSocket(self.request), self.host, self.port)
        if await ws.recv() is None:
            raise RuntimeError("WebSocket handshake refused")
        return ws

    @staticmethod
    async def receive(ws: WebSocket) -> dict[str, Any]:
        text = await ws.recv()
        if text is None:
            raise RuntimeError("connection ended")
        message: dict[str, Any] = json.loads(text)
        return message

    async def aclose(self) -> None:
        """Nothing is pooled; kept so both protocols end the same way."""


class Toolgym(Client):
    """toolgym protocol v1 on ``/v1/ws/counter``."""

    def __init__(self, base: str) -> None:
        super().__init__(base + "/v1/ws/counter?v=1")
        self.rid = 0

    async def open(self) -> Any:
        ws = await self.connect()
        await self.receive(ws)  # hello
        return ws

    async def rpc(self, ws: Any, frame: dict[str, Any]) -> None:
        self.rid += 1
        ws.send(json.dumps({"id": self.rid, **frame}))
        if not (await self.receive(ws))["ok"]:
            raise RuntimeError("error reply")

    async def reset(self, ws: Any) -> None:
        await self.rpc(ws, {"op": "reset", "kwargs": {}})

    async def call(self, ws: Any) -> None:
        await self.rpc(ws, {"op": "call", "tool": "increment", "args": {"step": 1}})

    async def close(self, ws: Any) -> None:
        await self.rpc(ws, {"op": "close"})
        await ws.close()


class OpenEnv(Client):
    """OpenEnv 0.10's WebSocket protocol on ``/ws``."""

    def __init__(self, base: str) -> None:
        super().__init__(base + "/ws")

    async def open(self) -> Any:
        return await self.connect()

    async def rpc(self, ws: Any, frame: dict[str, Any]) -> None:
        ws.send(json.dumps(frame))
        if (await self.receive(ws)).get("type") == "error":
            raise RuntimeError("error reply")

    async def reset(self, ws: Any) -> None:
        await self.rpc(ws, {"type": "reset", "data": {}})

    async def call(self, ws: Any) -> None:
        await self.rpc(ws, {"type": "step", "data": {"step": 1}})

    async def close(self, ws: Any) -> None:
        ws.send(json.dumps({"type": "close"}))
        await ws.close()


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def calls(proto: Any, sessions: int, duration: float) -> dict[str, Any]:
    """Open ``sessions`` at once (timing connect -> first reset reply), then call for ``duration`` s."""
    opened: list[float] = []
    latencies: list[float] = []
    errors = 0
    all_open = asyncio.Event()
    measuring = asyncio.Event()
    stop = asyncio.Event()

    async def session() -> None:
        nonlocal errors
        started = time.perf_counter()
        try:
            ws = await proto.open()
            await proto.reset(ws)
        except Exception:
            errors += 1
            opened.append(float("nan"))
            if len(opened) == sessions:
                all_open.set()
            return
        opened.append(time.perf_counter() - started)
        if len(opened) == sessions:
            all_open.set()
        await all_open.wait()
        try:
            while not stop.is_set():
                t = time.perf_counter()
                await proto.call(ws)
                if measuring.is_set() and not stop.is_set():
                    latencies.append(time.perf_counter() - t)
            await proto.close(ws)
        except Exception:
            errors += 1

    tasks = [asyncio.create_task(session()) for _ in range(sessions)]
    await all_open.wait()
    await asyncio.sleep(min(1.0, duration / 5))  # warm-up
    measuring.set()
    print("measuring", flush=True)  # run.py samples the server's CPU time at these two lines
    t0 = time.perf_counter()
    await asyncio.sleep(duration)
    stop.set()
    elapsed = time.perf_counter() - t0
    measured = len(latencies)
    print("stopped", flush=True)
    await asyncio.gather(*tasks)
    good = [o for o in opened if o == o]
    return {"sessions": sessions, "calls": measured, "calls_per_s": measured / elapsed,
            "p50_ms": _pct(latencies, 0.5) * 1e3, "p99_ms": _pct(latencies, 0.99) * 1e3,
            "open_p50_s": statistics.median(good) if good else None, "open_max_s": max(good) if good else None,
            "errors": errors}


async def churn(proto: Any, workers: int, duration: float) -> dict[str, Any]:
    """``workers`` loops of open, reset, one call, close for ``duration`` s."""
    done = 0
    errors = 0
    deadline = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < deadline:
            try:
                ws = await proto.open()
                await proto.reset(ws)
                await proto.call(ws)
                await proto.close(ws)
                done += 1
            except Exception:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return {"workers": workers, "sessions": done, "sessions_per_s": done / (time.perf_counter() - t0), "errors": errors}


async def run(mode: str, proto: Toolgym | OpenEnv, count: int, duration: float) -> dict[str, Any]:
    """One phase, then the client's connection pool is closed."""
    try:
        return await (calls(proto, count, duration) if mode == "calls" else churn(proto, count, duration))
    finally:
        await proto.aclose()


def main(argv: list[str]) -> None:
    """``load.py calls|churn toolgym|openenv URL N DURATION``; prints the result as JSON."""
    mode, kind, url, count, duration = argv[0], argv[1], argv[2], int(argv[3]), float(argv[4])
    proto = Toolgym(url) if kind == "toolgym" else OpenEnv(url)
    try:
        import uvloop  # the same loop for both servers' client, when available
        result = uvloop.run(run(mode, proto, count, duration))
    except ImportError:
        result = asyncio.run(run(mode, proto, count, duration))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
