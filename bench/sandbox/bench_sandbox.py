"""Cost of the sandbox per run, before and after it became an OS sandbox, measured interleaved in one run.

    .venv/bin/python bench/sandbox/bench_sandbox.py [RUNS]

Median (and p90) wall time of ``run_python("print(1)")`` and of grading a 4-test solution, under:
``before``: the old audit-hook sandbox, ``environments/sandbox.py`` as of commit ``BEFORE``, read
from git history (its grading was one run of the solution with the tests appended); ``weak``: today's
weak mode; ``bwrap``: today's default. Then bare interpreter starts, for scale. The variants take turns
call by call, so load from other processes falls on all of them alike. bench/sandbox/README.md has figures.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

from environments.sandbox import Isolation, Limits, run_python, score_tests

BEFORE = "635ea7e9ec60a0f6d22a91c2417e61c1e0b70129"
SNIPPET = "print(1)"
SOLUTION = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
TESTS = ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(20) == 6765"]
LIMITS = Limits(wall_seconds=60.0)
Case = Callable[[], object]


def _now(mode: Isolation) -> dict[str, Case]:
    def run() -> object:
        result = run_python(SNIPPET, LIMITS, mode=mode)
        assert result.ok and result.output == "1\n", result
        return result

    def grade() -> object:
        score = score_tests(SOLUTION, TESTS, LIMITS, mode=mode)
        assert score == 1.0, score
        return score

    return {"run": run, "grade": grade}


def _before() -> dict[str, Case] | None:
    """The old sandbox module, loaded from git history; ``None`` without git or that commit."""
    show = subprocess.run(["git", "show", f"{BEFORE}:environments/sandbox.py"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent, check=False)
    if show.returncode != 0:
        return None
    old = sys.modules["old_sandbox"] = types.ModuleType("old_sandbox")  # dataclasses look their module up
    exec(compile(show.stdout, "old_sandbox.py", "exec"), vars(old))
    limits = old.Limits(wall_seconds=60.0)

    def run() -> object:
        result = old.run_python(SNIPPET, limits)
        assert result.ok and result.output == "1\n", result
        return result

    def grade() -> object:
        result = old.run_python(SOLUTION + "\n" + "\n".join(TESTS) + "\n", limits)
        assert result.ok, result
        return result

    return {"run": run, "grade": grade}


def _bare(flags: list[str]) -> dict[str, Case]:
    """A bare interpreter start with ``flags``: what any interpreter-per-run design pays."""
    return {"run": lambda: subprocess.run([sys.executable, *flags, "-c", SNIPPET], capture_output=True, check=True)}


def main(runs: int) -> None:
    """Time ``runs`` calls of each case of each variant, the variants taking turns."""
    variants = {"before": _before(), "weak": _now(Isolation.WEAK), "bwrap": _now(Isolation.BWRAP),
                "bare python -I": _bare(["-I"]), "bare python -I -S": _bare(["-I", "-S"])}
    if variants["before"] is None:
        print(f"(no 'before': git history with {BEFORE[:7]} is not available)")
    present = {name: cases for name, cases in variants.items() if cases is not None}
    times: dict[tuple[str, str], list[float]] = {}
    for case in ("run", "grade"):
        takers = {name: cases[case] for name, cases in present.items() if case in cases}
        for call in takers.values():  # warm-up: first-call costs (ldd scan, seccomp compile, page cache)
            call()
        for _ in range(runs):
            for name, call in takers.items():
                start = time.perf_counter()
                call()
                times.setdefault((case, name), []).append(time.perf_counter() - start)
    print(f"median (p90) ms of {runs} calls; ratio = bwrap / before")
    print(f"{'':<22}" + "".join(f"{name:>22}" for name in present) + f"{'ratio':>8}")
    for case, label in (("run", "run_python(print(1))"), ("grade", "grading, 4 tests")):
        cells, medians = [], {}
        for name in present:
            samples = times.get((case, name))
            if samples is None:
                cells.append(f"{'-':>22}")
                continue
            medians[name] = statistics.median(samples) * 1e3
            cells.append(f"{medians[name]:>13.1f} ({statistics.quantiles(samples, n=10)[-1] * 1e3:>6.1f})")
        ratio = f"{medians['bwrap'] / medians['before']:>8.2f}" if "before" in medians else ""
        print(f"{label:<22}" + "".join(cells) + ratio)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
