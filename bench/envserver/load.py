"""Load generator for bench/envserver: one client, two wire protocols (toolgym and OpenEnv).

Both servers get exactly the same client: aiohttp's WebSocket client without compression (its C
frame reader costs less than half the CPU per message of the ``websockets`` client, so the client
is less of a bottleneck), one connection per session, closed-loop requests. Only the frames differ.
Run by ``run.py`` in a subprocess; prints one JSON object::

    python bench/envserver/load.py calls toolgym http://127.0.0.1:8765 1024 5
    python bench/envserver/load.py churn openenv http://127.0.0.1:8766 32 5
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from typing import Any

import aiohttp


class Client:
    """One aiohttp session shared by every simulated session of a load process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http: aiohttp.ClientSession | None = None

    async def connect(self) -> aiohttp.ClientWebSocketResponse:
        if self.http is None:
            self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None, connect=120))
        return await self.http.ws_connect(self.url, compress=0, autoping=True, max_msg_size=0)

    @staticmethod
    async def receive(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
        message = await ws.receive()
        if message.type != aiohttp.WSMsgType.TEXT:
            raise RuntimeError(f"connection ended: {message.type}")
        return json.loads(message.data)

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.close()


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
        await ws.send_str(json.dumps({"id": self.rid, **frame}))
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
        await ws.send_str(json.dumps(frame))
        if (await self.receive(ws)).get("type") == "error":
            raise RuntimeError("error reply")

    async def reset(self, ws: Any) -> None:
        await self.rpc(ws, {"type": "reset", "data": {}})

    async def call(self, ws: Any) -> None:
        await self.rpc(ws, {"type": "step", "data": {"step": 1}})

    async def close(self, ws: Any) -> None:
        await ws.send_str(json.dumps({"type": "close"}))
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
    t0 = time.perf_counter()
    await asyncio.sleep(duration)
    stop.set()
    elapsed = time.perf_counter() - t0
    await asyncio.gather(*tasks)
    good = [o for o in opened if o == o]
    return {"sessions": sessions, "calls_per_s": len(latencies) / elapsed, "p50_ms": _pct(latencies, 0.5) * 1e3,
            "p99_ms": _pct(latencies, 0.99) * 1e3, "open_p50_s": statistics.median(good) if good else None,
            "open_max_s": max(good) if good else None, "errors": errors}


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
    return {"workers": workers, "sessions_per_s": done / (time.perf_counter() - t0), "errors": errors}


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
