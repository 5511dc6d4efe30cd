"""``score_tests``: the share of ``assert`` tests a solution passes, measured where it cannot cheat.

One sandboxed run holds two interpreters: the grader (``_grader.py``, trusted, started first)
evaluates the tests and holds the only descriptor of the result pipe; the solution runs in a child
of it (``_boot.py`` serve mode) and is reached only through calls whose arguments and results are
plain literals. The score is what the grader wrote on that pipe, clamped to [0, 1]; a solution that
crashes or exits early at any point, a run past its limits, or a missing or malformed result
scores 0. Nothing the solution prints is read.
"""

from __future__ import annotations

import marshal
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

from environments.sandbox._core import (
    BOOT_SOURCE,
    DEFAULT_LIMITS,
    Isolation,
    Limits,
    boot_config,
    isolation,
    launch,
    python_flags,
)

_GRADER_SOURCE = (Path(__file__).parent / "_grader.py").read_text(encoding="utf-8")
_MAX_RESULT = 4096


def score_tests(solution: str, tests: Sequence[str], limits: Limits = DEFAULT_LIMITS,
                mode: Isolation | None = None) -> float:
    """The fraction of ``tests`` that ``solution`` passes, in [0, 1].

    Args:
        solution: Python source defining what the tests call (functions taking and returning plain
            data: numbers, strings, bytes, None and lists/tuples/dicts/sets of them).
        tests: Python statements, typically ``assert f(1) == 2``, run one after another in one
            namespace where the solution's public callables (other than builtins' names) are bound.
        limits: Limits of the run (both interpreters, all tests, together).
        mode: The isolation; ``None`` is ``isolation()``.

    Returns:
        Passed tests / ``len(tests)``; 0.0 without tests, or when the solution crashed, exited
        early, timed out or broke the protocol.
    """
    if not tests:
        return 0.0
    mode = mode or isolation()
    nonce = secrets.token_hex(16)  # a report without it (a blind write to the pipe) is no report
    job = {"boot": BOOT_SOURCE, "boot_config": boot_config(mode, limits, "serve"), "flags": python_flags(mode),
           "solution": solution, "tests": list(tests), "nonce": nonce}
    result_read, result_write = os.pipe()
    try:
        finished = launch(mode, limits, _GRADER_SOURCE, str(result_write), marshal.dumps(job),
                          pass_fds=(result_write,))
        os.close(result_write)
        result_write = -1
        os.set_blocking(result_read, False)
        try:
            report = os.read(result_read, _MAX_RESULT + 1)
        except BlockingIOError:
            report = b""
    finally:
        os.close(result_read)
        if result_write >= 0:
            os.close(result_write)
    if finished.exit_code != 0 or finished.timed_out:
        return 0.0
    return _score(report, nonce, len(tests))


def _score(report: bytes, nonce: str, total: int) -> float:
    """The clamped score of the grader's report (``b"NONCE PASSED CRASHED"``); 0.0 for a crash or anything else."""
    match = re.fullmatch(re.escape(nonce.encode()) + rb" (\d{1,9}) ([01])", report)
    if match is None or match[2] != b"0":
        return 0.0
    return min(max(int(match[1]) / total, 0.0), 1.0)
