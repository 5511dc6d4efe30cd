"""Every command the README shows runs as written, in the README's order, on this machine.

The blocks run by the rules of ``tests/doc_blocks.py`` (which runs the docs' blocks too), from a
scratch copy of the repository root. ``make demo`` runs in the repository itself; ``make test`` is
what CI runs (``.ci/run``), so it is checked there rather than run again from inside the suite. The
README's blocks marked ``<!-- not run here: REASON -->`` need NVIDIA GPUs (each of their commands
names the GPUs it runs on) or are the suite's own commands (``pytest``, ``ruff``, ``mypy``).
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pytest

from tests.doc_blocks import ROOT, bare, blocks, commands, run_script, scratch_checkout, script

MIN_GAIN_Z = 2.0
README = ROOT / "README.md"
SUITE_COMMANDS = ("pytest", "ruff", "mypy")


def test_the_readme_has_the_two_commands_and_ci_runs_the_test_one() -> None:
    first = [c for b in blocks(README) if b.lang == "bash" for c in commands(b.body)][:2]
    assert [bare(c) for c in first] == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text().splitlines()


def test_commands_not_run_here_say_why_and_need_gpus_or_are_the_suite_s_own() -> None:
    skipped = [c for b in blocks(README) if b.lang == "bash" and b.note for c in commands(b.body)]
    for block in blocks(README):
        if block.lang == "bash" and block.note:
            assert block.note.startswith("not run here:"), block.note
    assert skipped
    for command in skipped:  # the suite's own commands: make test runs the tiers, the code-quality test ruff and mypy
        assert "CUDA_VISIBLE_DEVICES" in command or bare(command).split()[0] in SUITE_COMMANDS, command


@pytest.mark.vllm
@pytest.mark.timeout(1800)  # the README's runs, make demo included: 577-600+ s with a core busy elsewhere
def test_every_readme_command_runs_as_written(tmp_path: Path) -> None:
    work = scratch_checkout(tmp_path / "checkout")
    text = script(blocks(README), work, overrides={
        "make test": [],  # CI's own command (checked above); running it here would recurse
        "make demo": [f"cd {shlex.quote(str(ROOT))}", "make demo", 'cd "$OLDPWD"'],
    })
    returncode, stdout, stderr = run_script(text, work, timeout_s=1700)  # under the mark's limit: the output is kept
    assert returncode == 0, f"{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}"
    # The demo learned: its success rate rose by more than its evaluations' sampling noise, a
    # one-sided two-proportion z-test at MIN_GAIN_Z (p < 0.023). 576 episodes a side put the
    # standard error of the difference near 2.9 points; the demo's measured gains are in
    # bench/e2e/README.md. A policy that learned nothing passes with p < 0.023.
    row = re.search(r"success rate \(fresh episodes\)\s+([\d.]+)%\s+([\d.]+)%", stdout)
    count = re.search(r"success before training: [\d.]+% \((\d+) fresh episodes\)", stdout)
    assert row and count, stdout[-4000:]
    before, after, n = float(row.group(1)) / 100, float(row.group(2)) / 100, int(count.group(1))
    standard_error = math.sqrt((before * (1 - before) + after * (1 - after)) / n)
    assert after - before >= MIN_GAIN_Z * standard_error, (before, after, n)
    for run in ("counter", "counter-cli", "counter-yaml", "harness"):
        assert (work / "outputs" / run).is_dir(), f"the {run} run wrote nothing"
