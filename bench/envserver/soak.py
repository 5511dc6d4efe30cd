"""Soak: 10,000 sessions churned against one env server, a share of them ended the hard way.

    .venv/bin/python bench/envserver/soak.py                       # 1,000 warm-up + 10,000 sessions
    .venv/bin/python bench/envserver/soak.py --sessions 2000 --warmup 500 --workers 2

The server runs in this process (``envserver.ServerThread``, default limits but a 2 s resume grace
so dropped sessions expire within the run), hosting the counter and a ``soak`` environment whose
``work`` tool sleeps in the thread pool. Client processes (``--workers``, each ``--concurrency``
loops; the minimal client of ``load.py``) churn sessions, each one of:

* normal (65 %): open, reset, call, close;
* killed mid-call (10 %): open, reset, send a ``work`` call, abort the TCP connection (RST);
* dropped mid-frame (10 %): open, send half a frame, abort;
* dropped, then resumed (10 %): open, reset, call, abort, resume by id, call, close;
* dropped mid-handshake (5 %): half an upgrade request, abort.

Every ``--kill-every`` sessions one client process is killed with SIGKILL (its sessions die
wherever they were) and replaced. After the warm-up and again after the soak, once the server has
settled (no session open, no connection left), it measures open sessions, threads, asyncio tasks
on the server's loop and the process RSS; the soak passes when no session is left, no thread or
task is left beyond the warm-up's, and RSS is within 10 % of the warm-up's. Prints the figures and
exits 1 on a failed check.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from load import Client, WebSocket, _frame  # noqa: E402  (bench/envserver is no package)

MIXES = [("normal", 65), ("killed_mid_call", 10), ("dropped_mid_frame", 10), ("resumed", 10),
         ("dropped_mid_handshake", 5)]


class SoakEnv:
    """A soak environment: one tool that sleeps in the server's thread pool."""

    def reset(self, **kwargs: Any) -> str:
        """Start an episode."""
        return "soak"

    def work(self, seconds: float) -> str:
        """Sleep, as a slow tool does.

        Args:
            seconds: How long.
        """
        time.sleep(min(seconds, 1.0))
        return "done"


# The client side (run as ``soak.py --client URL SEED CONCURRENCY`` in a subprocess).

async def _session(base: str, kind: str, rid: list[int]) -> None:
    def rpc(ws: WebSocket, frame: dict[str, Any]) -> None:
        rid[0] += 1
        ws.send(json.dumps({"id": rid[0], **frame}))

    async def reply(ws: WebSocket) -> dict[str, Any]:
        return await Client.receive(ws)

    if kind == "dropped_mid_handshake":
        client = Client(base + "/v1/ws/soak?v=1")
        _, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(client.request[:len(client.request) // 2])
        await writer.drain()
        writer.transport.abort()
        return
    ws = await Client(base + "/v1/ws/soak?v=1").connect()
    hello = await reply(ws)
    if kind == "dropped_mid_frame":
        frame = _frame(0x1, json.dumps({"id": 1, "op": "call", "tool": "work", "args": {"seconds": 0}}).encode())
        ws.transport.write(frame[:len(frame) // 2])  # type: ignore[union-attr]
        ws.transport.abort()  # type: ignore[union-attr]
        return
    rpc(ws, {"op": "reset"})
    await reply(ws)
    if kind == "killed_mid_call":
        rpc(ws, {"op": "call", "tool": "work", "args": {"seconds": 0.02}})
        ws.transport.abort()  # type: ignore[union-attr]
        return
    rpc(ws, {"op": "call", "tool": "work", "args": {"seconds": 0}})
    await reply(ws)
    if kind == "resumed":
        ws.transport.abort()  # type: ignore[union-attr]
        ws = await Client(base + f"/v1/ws/soak?v=1&session={hello['session']}").connect()
        await reply(ws)
        rpc(ws, {"op": "call", "tool": "work", "args": {"seconds": 0}})
        await reply(ws)
    rpc(ws, {"op": "close"})
    await reply(ws)
    await ws.close()


async def _client(base: str, seed: int, concurrency: int) -> None:
    rng = random.Random(seed)
    kinds = [kind for kind, weight in MIXES for _ in range(weight)]

    async def loop() -> None:
        rid = [0]
        while True:
            try:
                await _session(base, rng.choice(kinds), rid)
            except (OSError, RuntimeError, asyncio.IncompleteReadError):
                await asyncio.sleep(0.05)  # refused or dropped by the server: counted there

    await asyncio.gather(*(loop() for _ in range(concurrency)))


# The server side and the checks.

def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Soak:
    """The in-process server, its client processes and the settle-and-measure steps."""

    def __init__(self, args: argparse.Namespace) -> None:
        from environments.counter import IncrementEnv
        from envserver import EnvSpec, ServerConfig, ServerThread

        specs = {"counter": EnvSpec.from_factory("counter", IncrementEnv),
                 "soak": EnvSpec.from_factory("soak", SoakEnv)}
        self.args = args
        self.server = ServerThread(specs, ServerConfig(port=0, resume_grace=2.0, max_sessions=4096)).start()
        self.clients: list[subprocess.Popen[bytes]] = []
        self.killed = 0
        self._seed = 0

    def opened(self) -> int:
        """Sessions the server has opened so far."""
        return int(sum(_totals(self.server.table.metrics.sessions_total).values()))

    def spawn(self) -> None:
        self._seed += 1
        command = [sys.executable, __file__, "--client", self.server.url, str(self._seed), str(self.args.concurrency)]
        self.clients.append(subprocess.Popen(command, stderr=subprocess.DEVNULL))

    def kill_one(self) -> None:
        victim = self.clients.pop(random.randrange(len(self.clients)))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        self.killed += 1

    def churn(self, sessions: int) -> float:
        """Run the clients until the server has opened ``sessions`` more; seconds taken."""
        target, started = self.opened() + sessions, time.monotonic()
        for _ in range(self.args.workers):
            self.spawn()
        next_kill = self.opened() + self.args.kill_every
        while self.opened() < target:
            time.sleep(0.05)
            if self.opened() >= next_kill:
                self.kill_one()
                self.spawn()
                next_kill += self.args.kill_every
        while self.clients:  # stopping them is killing them too: whatever they were doing
            self.kill_one()
        return time.monotonic() - started

    def settle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until no session and no connection is left, collect garbage, then measure."""
        deadline = time.monotonic() + timeout
        state = self.server.server.server_state
        while (len(self.server.table) or state.connections) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        loop = self.server.server.servers[0].get_loop()
        tasks = asyncio.run_coroutine_threadsafe(_count_tasks(), loop).result(10)
        gc.collect()
        pool_threads = sum(thread.name.startswith(("toolgym-counter", "toolgym-soak"))
                           for thread in threading.enumerate())
        return {"sessions_open": len(self.server.table), "connections": len(state.connections),
                "threads": threading.active_count(), "pool_threads": pool_threads, "tasks": tasks,
                "rss_mib": round(_rss_mib(), 1)}

    def figures(self) -> dict[str, Any]:
        """Server-side counters: sessions by how they ended, resumes, frame errors."""
        metrics = self.server.table.metrics
        return {"opened": self.opened(), "evicted_by_env_reason": _totals(metrics.sessions_evicted),
                "resumed": int(sum(_totals(metrics.sessions_resumed).values())),
                "frame_errors": _totals(metrics.frame_errors)}

    def stop(self) -> None:
        while self.clients:
            self.kill_one()
        self.server.stop()


def _totals(counter: Any) -> dict[str, int]:
    """A Prometheus counter's values by label values (``env/reason``), read through its public API."""
    return {"/".join(sample.labels.values()) or "all": int(sample.value)
            for metric in counter.collect() for sample in metric.samples if sample.name.endswith("_total")}


async def _count_tasks() -> int:
    return len(asyncio.all_tasks()) - 1  # not this one


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print its figures; returns 1 when a check fails."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=1_000)
    parser.add_argument("--workers", type=int, default=4, help="client processes")
    parser.add_argument("--concurrency", type=int, default=8, help="session loops per client process")
    parser.add_argument("--kill-every", type=int, default=1_000, help="SIGKILL a client process every N sessions")
    parser.add_argument("--client", nargs=3, metavar=("URL", "SEED", "CONCURRENCY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        asyncio.run(_client(args.client[0], int(args.client[1]), int(args.client[2])))
        return 0
    print(f"load average before: {os.getloadavg()}", flush=True)
    soak = Soak(args)
    try:
        soak.churn(args.warmup)
        warm = soak.settle()
        print(f"after warm-up ({args.warmup} sessions): {json.dumps(warm)}", flush=True)
        seconds = soak.churn(args.sessions)
        done = soak.settle()
        print(f"after soak ({args.sessions} sessions in {seconds:.1f} s, {args.sessions / seconds:,.0f}/s, "
              f"{soak.killed} client processes killed): {json.dumps(done)}", flush=True)
        print(f"server counters: {json.dumps(soak.figures())}", flush=True)
    finally:
        soak.stop()
    print(f"load average after: {os.getloadavg()}", flush=True)
    checks = {
        "no session open": done["sessions_open"] == 0 and done["connections"] == 0,
        # Pools start threads on demand, up to 32 per environment; any other thread must be the warm-up's.
        "no thread leaked": (done["threads"] - done["pool_threads"] == warm["threads"] - warm["pool_threads"]
                             and done["pool_threads"] <= 2 * 32),
        "no task leaked": done["tasks"] <= warm["tasks"],
        "RSS within 10 % of warm-up": done["rss_mib"] <= 1.10 * warm["rss_mib"],
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
