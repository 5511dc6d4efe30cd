"""Benchmark: the toolgym env server against OpenEnv 0.10 on the same trivial counter environment.

    .venv/bin/python bench/envserver/run.py                      # full run, prints the table
    .venv/bin/python bench/envserver/run.py --with-inline        # adds toolgym with --inline-sync
    .venv/bin/python bench/envserver/run.py --duration 3 --sessions 16,256 --skip-openenv
    .venv/bin/python bench/envserver/run.py --baseline ../old   # adds the server of another checkout

Both servers run as one process with one uvicorn worker, pinned to CPU 0 when ``taskset`` exists;
the load generator (``load.py``, the same client for both) runs in its own process on CPU 1, and
only against 127.0.0.1. OpenEnv is installed on first use into its own venv under
``.cache/bench-openenv/`` (``pip install openenv==0.10.0 uvloop``). Figures per server: tool
calls/s and call latency p50/p99 with 16, 256 and 1,024 sessions calling in a closed loop; the p50
time to open a session (connect to first reset reply) with 1,024 opening at once; churn sessions/s
(open, reset, one call, close; 32 workers) with the server's CPU time per churn session (user +
system, all threads, from ``/proc``: the figure least moved by other jobs on a shared machine); the
server's CPU time per call over each calls phase's measured window (the same kind of figure, and
the one that says what the server costs when the client, not the server, bounds calls/s); and
sessions still alive after all that (worst round).
``--baseline PATH`` adds the toolgym server of another checkout as one more column (a before/after
with the same client in the same run).
The servers take turns over ``--repeat`` rounds, each round starting with the next server, and the
table shows each figure's median, since a shared machine's load moves the figures between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
OPENENV_VENV = ROOT / ".cache" / "bench-openenv" / "venv"
OPENENV_VERSION = "0.10.0"


def _pinned(cpu: int, command: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *command] if shutil.which("taskset") else command


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (loopback only)
        return json.loads(response.read())


def ensure_openenv() -> Path:
    """The OpenEnv venv's python, creating the venv on first use."""
    python = OPENENV_VENV / "bin" / "python"
    probe = [str(python), "-c", f"import importlib.metadata as m; assert m.version('openenv') == '{OPENENV_VERSION}'"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"installing openenv=={OPENENV_VERSION} into {OPENENV_VENV.relative_to(ROOT)} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(OPENENV_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"openenv=={OPENENV_VERSION}", "uvloop"], check=True)
    return python


class Server:
    """A server subprocess; ``live()`` counts its sessions (toolgym) or live environments (OpenEnv).

    Kinds: ``toolgym``, ``toolgym-inline`` (``--inline-sync``), ``toolgym@baseline`` (the toolgym
    server of the checkout at ``baseline``) and ``openenv``.
    """

    def __init__(self, kind: str, baseline: Path | None = None) -> None:
        self.kind = kind
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cwd = ROOT
        if kind.startswith("toolgym"):
            command = [sys.executable, "-m", "envserver.cli", "counter", "--port", str(self.port),
                       "--max-sessions", "4096", "--log-level", "warning"]
            if kind == "toolgym-inline":
                command.append("--inline-sync")
            if kind == "toolgym@baseline":
                assert baseline is not None
                cwd = baseline  # `python -m` imports envserver from the working directory first
        else:
            command = [str(ensure_openenv()), str(HERE / "openenv_counter.py"), "--port", str(self.port)]
        self.process = subprocess.Popen(_pinned(0, command), cwd=cwd)
        deadline = time.monotonic() + 120
        while True:
            try:
                _get(self.url + "/health")
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{kind} server did not start") from None
                time.sleep(0.2)

    def live(self) -> int:
        """Sessions (toolgym) or environment instances (OpenEnv) still alive, after 2 s to settle."""
        time.sleep(2)
        # A generous timeout: a server still working through closes on a loaded machine answers late.
        if self.kind.startswith("toolgym"):
            return int(_get(self.url + "/health", timeout=60)["sessions"])
        return int(_get(self.url + "/bench/live", timeout=60)["live"])

    def cpu_seconds(self) -> float:
        """CPU time (user + system, all threads) the server process has used so far; NaN without /proc."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """Terminate the server and wait for it."""
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def load(mode: str, kind: str, server: Server, count: int, duration: float) -> dict[str, Any]:
    """Run one load phase in a fresh client process; its JSON result.

    A calls phase also gets ``server_cpu_us_per_call``: the server's CPU time (``/proc``) over the
    client's measured window (between its ``measuring`` and ``stopped`` lines) per call answered
    in it. Unlike calls/s it does not depend on how fast the client is.
    """
    protocol = "openenv" if kind == "openenv" else "toolgym"
    command = _pinned(1, [sys.executable, str(HERE / "load.py"), mode, protocol, server.url, str(count), str(duration)])
    marks: dict[str, float] = {}
    lines: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT) as client:
        assert client.stdout is not None
        for line in client.stdout:
            line = line.strip()
            if line in ("measuring", "stopped"):
                marks[line] = server.cpu_seconds()
            elif line:
                lines.append(line)
        if client.wait(timeout=600) != 0:
            raise subprocess.CalledProcessError(client.returncode, command)
    result: dict[str, Any] = json.loads(lines[-1])
    if mode == "calls":
        result["server_cpu_us_per_call"] = 1e6 * (marks["stopped"] - marks["measuring"]) / max(result["calls"], 1)
    return result


def measure(kind: str, sessions: list[int], duration: float, churn_workers: int,
            baseline: Path | None = None) -> dict[str, Any]:
    """Every figure for one server kind."""
    server = Server(kind, baseline)
    try:
        results: dict[str, Any] = {"calls": {}}
        for count in sessions:
            results["calls"][count] = load("calls", kind, server, count, duration)
            print(f"  {kind} {count:>5} sessions: {json.dumps(results['calls'][count])}", flush=True)
        cpu = server.cpu_seconds()
        results["churn"] = load("churn", kind, server, churn_workers, duration)
        # The steadiest figure on a shared machine: contention slows a phase down, it barely changes this.
        results["churn"]["server_cpu_ms"] = 1e3 * (server.cpu_seconds() - cpu) / max(results["churn"]["sessions"], 1)
        print(f"  {kind} churn: {json.dumps(results['churn'])}", flush=True)
        results["live"] = server.live()
        return results
    finally:
        server.stop()


def median_of(runs: list[Any]) -> Any:
    """The element-wise median of equally shaped results (dicts of numbers, nested)."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: median_of([run[key] for run in runs]) for key in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(runs)
    return first


def table(results: dict[str, dict[str, Any]], sessions: list[int]) -> str:
    """The comparison as a Markdown table."""
    kinds = list(results)
    rows = [f"| figure | {' | '.join(kinds)} |", "|---|" + "---|" * len(kinds)]

    def row(label: str, values: list[str]) -> None:
        rows.append(f"| {label} | {' | '.join(values)} |")

    for count in sessions:
        calls = [results[k]["calls"][count] for k in kinds]
        row(f"tool calls/s, {count} sessions", [f"{c['calls_per_s']:,.0f}" for c in calls])
        row(f"call latency p50 / p99 (ms), {count} sessions", [f"{c['p50_ms']:.1f} / {c['p99_ms']:.1f}" for c in calls])
        row(f"server CPU per call (us), {count} sessions", [f"{c['server_cpu_us_per_call']:.1f}" for c in calls])
    biggest = max(sessions)
    row(f"session open p50 (s), {biggest} at once",
        [f"{results[k]['calls'][biggest]['open_p50_s']:.2f}" for k in kinds])
    row("churn sessions/s (open, reset, call, close)", [f"{results[k]['churn']['sessions_per_s']:,.0f}" for k in kinds])
    row("server CPU per churn session (ms)", [f"{results[k]['churn']['server_cpu_ms']:.2f}" for k in kinds])
    row("errors (all phases)", [str(sum(c["errors"] for c in results[k]["calls"].values())
                                    + results[k]["churn"]["errors"]) for k in kinds])
    row("sessions alive afterwards (worst round)", [str(results[k]["live"]) for k in kinds])
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measured phase")
    parser.add_argument("--sessions", default="16,256,1024", help="comma-separated session counts")
    parser.add_argument("--churn-workers", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds, the servers interleaved; the table shows per-figure medians")
    parser.add_argument("--skip-openenv", action="store_true", help="measure the toolgym server only")
    parser.add_argument("--with-inline", action="store_true",
                        help="also measure the toolgym server with --inline-sync (sync methods on the loop)")
    parser.add_argument("--baseline", type=Path,
                        help="also measure the toolgym server of this checkout (e.g. a git worktree of an "
                             "older commit), as toolgym@baseline")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    sessions = [int(s) for s in args.sessions.split(",")]
    if args.baseline is not None and not (args.baseline / "envserver" / "cli.py").is_file():
        parser.error(f"--baseline {args.baseline}: no envserver/cli.py there; pass a checkout of this repository")
    kinds = (["toolgym"] + (["toolgym-inline"] if args.with_inline else [])
             + (["toolgym@baseline"] if args.baseline else []) + ([] if args.skip_openenv else ["openenv"]))
    rounds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    print(f"load average before: {os.getloadavg()}", flush=True)
    for round_index in range(args.repeat):
        print(f"round {round_index + 1}/{args.repeat}", flush=True)
        # Each round starts with another server: none always runs first (or right after OpenEnv).
        for kind in kinds[round_index % len(kinds):] + kinds[:round_index % len(kinds)]:
            rounds[kind].append(measure(kind, sessions, args.duration, args.churn_workers, args.baseline))
    print(f"load average after: {os.getloadavg()}", flush=True)
    results = {kind: median_of(runs) for kind, runs in rounds.items()}
    results_live = {kind: max(run["live"] for run in runs) for kind, runs in rounds.items()}
    for kind in kinds:
        results[kind]["live"] = results_live[kind]  # the worst round, not the median
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=2))
    print()
    print(table(results, sessions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
