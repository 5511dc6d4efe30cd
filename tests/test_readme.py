"""Every command the README shows runs as written, in the README's order, on this machine.

The README's ``bash`` blocks run in one bash session from a scratch copy of the repository root
(``.venv`` and ``.cache`` are the repository's own). Each file a block names on its first line
(``# train_counter.py``, ``# counter.yaml``) is written there before the commands that follow it.
A command that ends in ``&`` starts a server: the session waits for its ``--port`` to answer
``/health`` before the next command, and every such server is stopped at the end. ``make demo``
runs in the repository itself; ``make test`` is what CI runs (``.ci/run``), so it is checked there
rather than run again from inside the suite. A block preceded by ``<!-- not run here: REASON -->``
needs hardware this machine lacks (NVIDIA GPUs); the test lists those commands and checks that
each names the GPUs it runs on.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIN_GAIN_Z = 2.0
README = ROOT / "README.md"
FENCE = re.compile(
    r"(?:<!--\s*(?P<note>[^>]*?)\s*-->\s*\n)?^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\n(?P<body>.*?)^(?P=indent)```",
    re.S | re.M)
WAIT_FOR_PORT = r'''
__readme_wait() {  # $1 port, $2 pid: wait until http://127.0.0.1:$1/health answers, fail if $2 exits
  for _ in $(seq 1 1200); do
    kill -0 "$2" 2>/dev/null || { echo "background command on port $1 exited" >&2; return 1; }
    python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2)" \
      2>/dev/null && return 0
    sleep 0.5
  done
  echo "nothing answered on port $1" >&2; return 1
}
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT
'''


@dataclass
class Block:
    """A fenced block of the README."""

    lang: str
    body: str
    note: str | None


def readme_blocks() -> list[Block]:
    """The README's fenced blocks, in order, with their indentation removed."""
    blocks = []
    for m in FENCE.finditer(README.read_text()):
        indent = m.group("indent")
        body = "".join(line[len(indent):] if line.startswith(indent) else line
                       for line in m.group("body").splitlines(keepends=True))
        blocks.append(Block(m.group("lang"), body, m.group("note")))
    return blocks


def commands(body: str) -> list[str]:
    """A bash block's commands (``\\``-continued lines joined; a heredoc stays with its command)."""
    out: list[str] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        command = line
        while command.rstrip().endswith("\\"):
            i += 1
            command += "\n" + lines[i]
        heredoc = re.search(r"<<'?(\w+)'?", command)
        if heredoc:
            while lines[i].strip() != heredoc.group(1):
                i += 1
                command += "\n" + lines[i]
        out.append(command)
        i += 1
    return out


def _strip_comment(command: str) -> str:
    words = shlex.split(command.replace("\\\n", " ").split("\n")[0], comments=True)
    return " ".join(words)


def test_the_readme_has_the_two_commands_and_ci_runs_the_test_one() -> None:
    first = [c for b in readme_blocks() if b.lang == "bash" for c in commands(b.body)][:2]
    assert [_strip_comment(c) for c in first] == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text().splitlines()


def test_commands_not_run_here_say_why_and_need_gpus() -> None:
    gpu = [c for b in readme_blocks() if b.lang == "bash" and b.note for c in commands(b.body)]
    for block in readme_blocks():
        if block.lang == "bash" and block.note:
            assert block.note.startswith("not run here:"), block.note
    assert all("CUDA_VISIBLE_DEVICES" in c for c in gpu), gpu


@pytest.mark.vllm
@pytest.mark.timeout(1800)  # the README's runs, make demo included: 577-600+ s with a core busy elsewhere
def test_every_readme_command_runs_as_written(tmp_path: Path) -> None:
    blocks = readme_blocks()
    work = tmp_path / "checkout"
    work.mkdir()
    (ROOT / ".cache").mkdir(exist_ok=True)
    for name in (".venv", ".cache"):
        (work / name).symlink_to(ROOT / name)
    script = ["set -euo pipefail", WAIT_FOR_PORT]
    for block in blocks:
        first = block.body.splitlines()[0] if block.body else ""
        if block.lang != "bash" and re.fullmatch(r"# [\w/.-]+\.(py|yaml)", first):
            path = work / first[2:]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.body)
            continue
        if block.lang != "bash" or block.note:
            continue
        for command in commands(block.body):
            bare = _strip_comment(command)
            if bare == "make test":
                continue  # CI's own command (checked above); running it here would recurse
            if bare == "make demo":
                script += [f"cd {shlex.quote(str(ROOT))}", command, 'cd "$OLDPWD"']
                continue
            script.append(command)
            if bare.endswith("&"):
                port = re.search(r"--port[ =](\d+)", bare)
                assert port, f"a background command must name its --port: {command}"
                script.append(f"__readme_wait {port.group(1)} $!")
    # A session of its own: past the limit, the script and the servers it started in the background
    # are killed together (the script's EXIT trap does not run on SIGKILL), freeing their ports.
    with subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=work, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=1700)  # under the mark's limit: the output is kept
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"the README's commands ran past 1,700 s\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}")
    assert proc.returncode == 0, f"{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}"
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
