"""What bounding a run's memory costs per run, and what each memory attack holds, before and after, in one run.

    .venv/bin/python bench/sandbox/bench_memory.py [--runs N] [--before COMMIT] [--attack NAME]... [--skip-attacks]

Variants: ``before``: the sandbox as of ``COMMIT`` (default: the commit before the memory bounds),
extracted from git history into a temporary directory and driven in a worker process that times
each call itself; ``rlimits``: today's sandbox with its memory cgroup switched off (the seccomp
filter and rlimits alone, as on a machine without cgroups); ``cgroup``: today's default where the
server can make a memory cgroup per run. Cost: median (p90) ms of ``run_python("print(1)")`` and of
grading 4 tests, the variants taking turns call by call. Attacks (``tests/environments/sandbox_attacks.py``,
at the default limits): what the attack reports holding, the host's Shmem peak rise and largest
MemAvailable fall while it ran (``/proc/meminfo`` every 10 ms), and both just after it returned.
bench/sandbox/README.md has figures.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the attacks live with the tests that hold them

from environments.sandbox import DEFAULT_LIMITS, Limits, _cgroup, run_python, score_tests  # noqa: E402
from tests.environments.sandbox_attacks import ATTACKS, HostMemory, meminfo  # noqa: E402

BEFORE = "aec9a56"
SOLUTION = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
TESTS = ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(20) == 6765"]
MiB = 1 << 20
# The worker: the old sandbox, imported from the extracted tree (ahead of the editable install's finder,
# which comes last on sys.meta_path).
WORKER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from environments.sandbox import Limits, run_python, score_tests
for line in sys.stdin:
    job = json.loads(line)
    start = time.perf_counter()
    if job["op"] == "run":
        result = run_python(job["code"], Limits(**job["limits"]))
        answer = {"output": result.output, "exit_code": result.exit_code}
    else:
        answer = {"score": score_tests(job["solution"], job["tests"], Limits(**job["limits"]))}
    answer["seconds"] = time.perf_counter() - start
    print(json.dumps(answer), flush=True)
"""


class Before:
    """The sandbox of ``commit`` in a worker process: ``call`` sends one job and returns the worker's answer."""

    def __init__(self, commit: str, directory: Path) -> None:
        archive = subprocess.run(["git", "archive", commit, "environments", "sdk"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(directory, filter="data")
        self.process = subprocess.Popen([sys.executable, "-c", WORKER, str(directory)], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=directory)

    def call(self, **job: object) -> dict[str, object]:
        """Run one job (``op``: ``run`` with ``code``, or ``grade`` with ``solution`` and ``tests``; ``limits``)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        answer: dict[str, object] = json.loads(self.process.stdout.readline())
        return answer

    def close(self) -> None:
        """End the worker."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def _limits(limits: Limits) -> dict[str, object]:
    """The fields the old ``Limits`` also has."""
    return {name: getattr(limits, name) for name in ("cpu_seconds", "memory_bytes", "output_bytes", "wall_seconds",
                                                     "processes", "disk_bytes")}


def _now(cgroup: bool) -> Callable[[str, str], dict[str, object]]:
    """Today's sandbox with or without its memory cgroup, answering like ``Before.call``."""
    def call(op: str, code: str) -> dict[str, object]:
        _cgroup.enabled = cgroup
        start = time.perf_counter()
        if op == "run":
            result = run_python(code, DEFAULT_LIMITS)
            answer: dict[str, object] = {"output": result.output, "exit_code": result.exit_code}
        else:
            answer = {"score": score_tests(SOLUTION, TESTS, DEFAULT_LIMITS)}
        answer["seconds"] = time.perf_counter() - start
        return answer
    return call


def _variants(before: Before) -> dict[str, Callable[[str, str], dict[str, object]]]:
    def old(op: str, code: str) -> dict[str, object]:
        return before.call(op=op, code=code, solution=SOLUTION, tests=TESTS, limits=_limits(DEFAULT_LIMITS))
    return {"before": old, "rlimits": _now(cgroup=False), "cgroup": _now(cgroup=True)}


def cost(variants: dict[str, Callable[[str, str], dict[str, object]]], runs: int) -> None:
    """Print the median (p90) ms of a trivial run and of a 4-test grading under each variant."""
    print(f"median (p90) ms of {runs} calls, variants taking turns")
    print(f"{'':<22}" + "".join(f"{name:>18}" for name in variants))
    for op, label in (("run", "run_python(print(1))"), ("grade", "grading, 4 tests")):
        times: dict[str, list[float]] = {name: [] for name in variants}
        for call in variants.values():  # warm-up: first-call costs (ldd scan, seccomp compile, cgroup probe)
            call(op, "print(1)")
        for _ in range(runs):
            for name, call in variants.items():
                answer = call(op, "print(1)")
                assert answer.get("output", "1\n") == "1\n" and answer.get("score", 1.0) == 1.0, answer
                times[name].append(float(answer["seconds"]))  # type: ignore[arg-type]
        cells = [f"{statistics.median(t) * 1e3:>9.1f} ({statistics.quantiles(t, n=10)[-1] * 1e3:>5.1f})"
                 for t in times.values()]
        print(f"{label:<22}" + "".join(f"{cell:>18}" for cell in cells))


def attacks(variants: dict[str, Callable[[str, str], dict[str, object]]], names: list[str]) -> None:
    """Run each attack of ``names`` under each variant; print what it held and what the host saw."""
    print("\nattack           variant   held MiB  Shmem peak +MiB  MemAvailable fall MiB  after: Shmem +MiB, "
          "MemAvailable -MiB  ended with")
    for attack in names:
        for name, call in variants.items():
            with HostMemory() as host:
                answer = call("run", ATTACKS[attack])
            after = meminfo()
            output = str(answer["output"]).strip().splitlines()
            last = output[-1] if output else ""
            held = int(last.split()[-1]) >> 20 if last.startswith(("REFUSED", "HELD")) else None
            ended = " ".join(last.split()[:3]) if held is not None else f"exit {answer['exit_code']}"
            print(f"{attack:<16} {name:<9} {held if held is not None else '-':>8} {host.shmem_rise // MiB:>16} "
                  f"{host.available_fall // MiB:>22}  {(after['Shmem'] - host.before['Shmem']) // MiB:>17}, "
                  f"{(host.before['MemAvailable'] - after['MemAvailable']) // MiB:>17}  {ended}")
            host.settled(shmem_slack=16 * MiB, available_slack=256 * MiB, timeout=30.0)  # the next starts clean


def main() -> None:
    """Parse the arguments and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the commit whose sandbox is 'before'")
    parser.add_argument("--runs", type=int, default=40, help="calls per variant and case (0: no cost figures)")
    parser.add_argument("--attack", action="append", choices=sorted(ATTACKS), help="only these attacks")
    parser.add_argument("--skip-attacks", action="store_true")
    args = parser.parse_args()
    print(f"memory cgroup here: {_cgroup.hierarchy()}")
    with tempfile.TemporaryDirectory(prefix="toolgym-before-") as directory:
        before = Before(args.before, Path(directory))
        try:
            variants = _variants(before)
            if args.runs:
                cost(variants, args.runs)
            if not args.skip_attacks:
                attacks(variants, args.attack or list(ATTACKS))
        finally:
            before.close()


if __name__ == "__main__":
    main()
