"""The linter and the type checker pass: ruff over the code, tests, benchmarks and scripts, and mypy
(strict on the library packages) as configured in ``pyproject.toml``.

mypy keeps its incremental cache in ``.mypy_cache`` at the repository root: the first run on a clean
clone reads the torch/transformers/vLLM annotations (minutes on a slow machine), later runs take seconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTED = ["sdk", "envserver", "environments", "trainer", "toolgym", "tests", "bench", "examples", "scripts"]


def _run(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def test_ruff_reports_nothing() -> None:
    result = _run("ruff", "check", *LINTED, timeout_s=120)
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}{result.stderr}"


@pytest.mark.slow  # 20 s with a warm cache, minutes on a clean clone
def test_mypy_strict_reports_nothing() -> None:
    result = _run("mypy", timeout_s=540)  # the packages and the strictness come from [tool.mypy]
    assert result.returncode == 0, f"mypy failed:\n{result.stdout}{result.stderr}"
    assert "Success: no issues found" in result.stdout, result.stdout
