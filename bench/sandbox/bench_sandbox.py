"""Cost of the sandbox per run: median wall time of a trivial snippet, weak mode (the old audit-hook
subprocess) against bubblewrap, and of grading a 4-test solution, measured interleaved in one run.

    .venv/bin/python bench/sandbox/bench_sandbox.py [RUNS]

Prints one line per case with the bubblewrap / weak ratio, then bare interpreter starts for scale
(bench/sandbox/README.md has figures).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from environments.sandbox import Isolation, Limits, run_python, score_tests

SNIPPET = "print(1)"
SOLUTION = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
TESTS = ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(20) == 6765"]
LIMITS = Limits(wall_seconds=60.0)


def _cases(mode: Isolation) -> dict[str, Callable[[], object]]:
    def run() -> object:
        result = run_python(SNIPPET, LIMITS, mode=mode)
        assert result.ok and result.output == "1\n", result
        return result

    def grade() -> object:
        score = score_tests(SOLUTION, TESTS, LIMITS, mode=mode)
        assert score == 1.0, score
        return score

    return {"run_python(print(1))": run, "score_tests(4 tests)": grade}


def _bare(flags: list[str]) -> Callable[[], object]:
    """A bare interpreter start with ``flags``, for scale: what any subprocess-per-run design pays."""
    return lambda: subprocess.run([sys.executable, *flags, "-c", "print(1)"], capture_output=True, check=True)


def main(runs: int) -> None:
    """Time ``runs`` calls of each case in each mode, alternating modes call by call."""
    cases = {mode: _cases(mode) for mode in Isolation}
    times: dict[tuple[Isolation, str], list[float]] = {}
    for name in cases[Isolation.WEAK]:
        for mode in Isolation:  # warm-up: first-call costs (ldd scan, seccomp compile, page cache)
            cases[mode][name]()
        for _ in range(runs):
            for mode in Isolation:
                start = time.perf_counter()
                cases[mode][name]()
                times.setdefault((mode, name), []).append(time.perf_counter() - start)
    bare = {"python -I": _bare(["-I"]), "python -I -S": _bare(["-I", "-S"])}
    bare_times: dict[str, list[float]] = {name: [] for name in bare}
    for _ in range(runs):
        for name, call in bare.items():
            start = time.perf_counter()
            call()
            bare_times[name].append(time.perf_counter() - start)
    print(f"{'case':<24} {'weak ms':>9} {'bwrap ms':>9} {'ratio':>6}   (median of {runs}, p90 in brackets)")
    for name in cases[Isolation.WEAK]:
        weak, bwrap = (times[(mode, name)] for mode in (Isolation.WEAK, Isolation.BWRAP))
        med_weak, med_bwrap = statistics.median(weak) * 1e3, statistics.median(bwrap) * 1e3
        p90 = [statistics.quantiles(t, n=10)[-1] * 1e3 for t in (weak, bwrap)]
        print(f"{name:<24} {med_weak:>9.1f} {med_bwrap:>9.1f} {med_bwrap / med_weak:>6.2f}"
              f"   [{p90[0]:.1f} / {p90[1]:.1f}]")
    for name, samples in bare_times.items():
        print(f"bare {name:<19} {statistics.median(samples) * 1e3:>9.1f}   (no sandbox, for scale)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
