"""Benchmark: OpenEnv's own client against toolgym's OpenEnv face and against OpenEnv's own server.

    .venv/bin/python bench/envserver/openenv_face.py                    # ~15 min: 16 and 1,024 sessions
    .venv/bin/python bench/envserver/openenv_face.py --sessions 1024 --repeat 1  # one round, ~4 min

The same counter on both servers: toolgym serves ``environments.counter:IncrementEnv`` at
``/openenv/counter`` (a step is OpenEnv's call-tool action for ``increment``, answered with the
reward ``get_reward()`` gives after it); OpenEnv 0.10 serves ``openenv_counter.py``, the same logic
in its action style (``{"step": 1}``). One server process each, pinned to CPU 0, one after the other,
``--repeat`` rounds with the order alternating (the table shows each figure's median: a shared
machine's load moves the figures between phases).
The load is OpenEnv's ``GenericEnvClient`` (async, one per session, each its own WebSocket) in
``--clients`` processes of the OpenEnv venv (``make setup`` makes ``.cache/openenv/venv``) pinned to
CPU 1: every session opens and resets, then all call ``step`` in a closed loop for ``--duration``
seconds from a common start, once every process is ready. Figures per server and session count:
calls/s, call latency p50/p99, the server's CPU time per call over the window (``/proc``: unlike
calls/s, it does not depend on how fast the client is) and errors. Run as ``openenv_face.py load
URL ACTION N DURATION`` it is one client process (the OpenEnv venv's python).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OPENENV_PYTHON = ROOT / ".cache" / "openenv" / "venv" / "bin" / "python"
ACTIONS = {"toolgym": {"type": "call_tool", "tool_name": "increment", "arguments": {"step": 1}},
           "openenv": {"step": 1}}


async def _load(url: str, action: dict[str, Any], sessions: int, duration: float) -> dict[str, Any]:
    """One client process: open and reset ``sessions`` GenericEnvClients, print ``ready``, read the
    common start time (epoch seconds) from stdin, then call ``step`` until ``duration`` s past it."""
    from openenv.core import GenericEnvClient

    latencies: list[float] = []
    errors = 0
    clients = [GenericEnvClient(base_url=url, message_timeout_s=120) for _ in range(sessions)]

    async def open_one(client: Any) -> bool:
        nonlocal errors
        try:
            await client.connect()
            await client.reset()
            return True
        except Exception:
            errors += 1
            return False

    async def calls(client: Any, start: float) -> None:
        nonlocal errors
        await asyncio.sleep(max(0.0, start - time.time()))
        try:
            while time.time() < start + duration:
                t = time.perf_counter()
                await client.step(action)
                latencies.append(time.perf_counter() - t)
        except Exception:
            errors += 1

    opened = [c for c, ok in zip(clients, await asyncio.gather(*map(open_one, clients)), strict=True) if ok]
    print("ready", flush=True)
    start = float(await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline))
    await asyncio.gather(*(calls(client, start) for client in opened))
    await asyncio.gather(*(client.close() for client in clients), return_exceptions=True)
    return {"calls": len(latencies), "latencies_ms": sorted(1e3 * x for x in latencies), "errors": errors}


def _pinned(cpu: int, command: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *command] if shutil.which("taskset") else command


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def phase(kind: str, server: Any, sessions: int, clients: int, duration: float) -> dict[str, Any]:
    """Every client process against ``server`` with ``sessions`` sessions in all; the merged figures."""
    base = server.url + ("/openenv/counter" if kind == "toolgym" else "")
    shares = [n for n in (sessions // clients + (i < sessions % clients) for i in range(clients)) if n]
    command = [str(OPENENV_PYTHON), __file__, "load", base, json.dumps(ACTIONS[kind])]
    procs = [subprocess.Popen(_pinned(1, [*command, str(n), str(duration)]), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT) for n in shares]
    for proc in procs:  # every session of every process is open and reset before the calls start
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    start = time.time() + 0.5
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{start}\n")
        proc.stdin.flush()
    time.sleep(max(0.0, start - time.time()))
    cpu0 = server.cpu_seconds()
    time.sleep(duration)
    cpu1 = server.cpu_seconds()
    results = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    latencies = sorted(x for r in results for x in r["latencies_ms"])
    calls = sum(r["calls"] for r in results)
    return {"sessions": sessions, "calls_per_s": calls / duration, "p50_ms": _pct(latencies, 0.5),
            "p99_ms": _pct(latencies, 0.99), "server_cpu_us_per_call": 1e6 * (cpu1 - cpu0) / max(calls, 1),
            "errors": sum(r["errors"] for r in results)}


def main(argv: list[str] | None = None) -> int:
    """Measure both servers and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", default="16,1024", help="comma-separated session counts")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of calls per phase")
    parser.add_argument("--clients", type=int, default=4, help="client processes (all on CPU 1)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds, the servers' order alternating; the table shows per-figure medians")
    args = parser.parse_args(argv)
    if not OPENENV_PYTHON.exists():
        parser.error(f"{OPENENV_PYTHON.relative_to(ROOT)} is missing: run `make setup`")
    sys.path.insert(0, str(HERE))
    import run  # the server processes of bench/envserver/run.py, with the OpenEnv venv of make setup

    run.OPENENV_VENV = OPENENV_PYTHON.parents[1]
    counts = [int(s) for s in args.sessions.split(",")]
    print(f"load average before: {os.getloadavg()}", flush=True)
    rounds: dict[str, list[dict[int, dict[str, Any]]]] = {"toolgym": [], "openenv": []}
    for index in range(args.repeat):
        for kind in ("toolgym", "openenv")[index % 2:] + ("toolgym", "openenv")[:index % 2]:  # alternate the order
            server = run.Server(kind)
            try:
                rounds[kind].append({})
                for count in counts:
                    rounds[kind][-1][count] = phase(kind, server, count, args.clients, args.duration)
                    print(f"  round {index + 1} {kind} {count:>5} sessions: {json.dumps(rounds[kind][-1][count])}",
                          flush=True)
            finally:
                server.stop()
    results = {kind: run.median_of(runs) for kind, runs in rounds.items()}
    print(f"load average after: {os.getloadavg()}", flush=True)
    print("\n| figure | toolgym /openenv/counter | OpenEnv 0.10 | ratio |\n|---|---|---|---|")
    for count in counts:
        ours, theirs = results["toolgym"][count], results["openenv"][count]
        print(f"| calls/s, {count} sessions | {ours['calls_per_s']:,.0f} | {theirs['calls_per_s']:,.0f} | "
              f"{ours['calls_per_s'] / max(theirs['calls_per_s'], 1e-9):.1f}x |")
        print(f"| call latency p50 / p99 (ms), {count} sessions | {ours['p50_ms']:.1f} / {ours['p99_ms']:.1f} | "
              f"{theirs['p50_ms']:.1f} / {theirs['p99_ms']:.1f} | |")
        print(f"| server CPU per call (us), {count} sessions | {ours['server_cpu_us_per_call']:.1f} | "
              f"{theirs['server_cpu_us_per_call']:.1f} | "
              f"{theirs['server_cpu_us_per_call'] / max(ours['server_cpu_us_per_call'], 1e-9):.1f}x |")
        print(f"| errors, {count} sessions | {ours['errors']} | {theirs['errors']} | |")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"]:
        url, action, count, duration = sys.argv[2:6]
        print(json.dumps(asyncio.run(_load(url, json.loads(action), int(count), float(duration)))))
    else:
        sys.exit(main())
