"""The fenced blocks of a Markdown page, and the bash script that runs them as written.

Shared by ``tests/test_readme.py`` and ``tests/test_docs.py``. The rules, the same for every page:

* a block whose first line names a file (``# my_envs/counter.py``, ``# fsdp.yaml``) is written there,
  in the scratch directory the script runs from, before any command runs;
* any other ``python`` block is a script: written to ``block_at_line_N.py`` (N: its first line on
  the page) and run with ``python``;
* each command of a ``bash`` block runs in one bash session, in the page's order; a command that
  ends in ``&`` starts a server: the session waits for its ``--port`` to answer ``/health`` before
  the next command, and every such server is stopped at the end;
* a block preceded by ``<!-- not run here: REASON -->`` is not run (it needs hardware this machine
  lacks, or serves on every interface...); other blocks (``json``, plain) are never run.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(
    r"(?:<!--\s*(?P<note>[^>]*?)\s*-->\s*\n)?^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\n(?P<body>.*?)^(?P=indent)```",
    re.S | re.M)
FILE_LINE = re.compile(r"# (?P<path>[\w/.-]+\.(py|yaml))")
NOT_RUN = "not run here:"
WAIT_FOR_PORT = r'''
__doc_wait() {  # $1 port, $2 pid: wait until http://127.0.0.1:$1/health answers, fail if $2 exits
  for _ in $(seq 1 1200); do
    kill -0 "$2" 2>/dev/null || { echo "background command on port $1 exited" >&2; return 1; }
    python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2)" \
      2>/dev/null && return 0
    sleep 0.5
  done
  echo "nothing answered on port $1" >&2; return 1
}
trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT
'''


@dataclass
class Block:
    """A fenced block of a Markdown page: its language, its text (unindented), the comment before it and
    the line its text starts on."""

    lang: str
    body: str
    note: str | None
    line: int

    @property
    def file(self) -> str | None:
        """The path a non-bash block names on its first line (``# train_counter.py``), if any."""
        first = self.body.splitlines()[0] if self.body else ""
        match = FILE_LINE.fullmatch(first)
        return match.group("path") if match and self.lang != "bash" else None

    @property
    def runs(self) -> bool:
        """Whether the script runs this block (a bash or python block without the not-run note)."""
        return self.lang in ("bash", "python") and not (self.note or "").startswith(NOT_RUN)


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, in order, with their indentation removed."""
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        indent = m.group("indent")
        body = "".join(line[len(indent):] if line.startswith(indent) else line
                       for line in m.group("body").splitlines(keepends=True))
        found.append(Block(m.group("lang"), body, m.group("note"), text.count("\n", 0, m.start("body")) + 1))
    return found


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


def bare(command: str) -> str:
    """A command's first line without its comment, words single-spaced (``make demo   # ...`` -> ``make demo``)."""
    return " ".join(shlex.split(command.replace("\\\n", " ").split("\n")[0], comments=True))


def script(page_blocks: Sequence[Block], work: Path, overrides: Mapping[str, Sequence[str]] | None = None) -> str:
    """The bash script that runs ``page_blocks`` from ``work``, writing their files there now.

    ``overrides`` maps a command (its :func:`bare` form) to the lines run instead; an empty list
    skips it.
    """
    lines = ["set -euo pipefail", WAIT_FOR_PORT]
    for block in page_blocks:
        if block.file:
            path = work / block.file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.body)
            continue
        if not block.runs:
            continue
        if block.lang == "python":
            name = f"block_at_line_{block.line}.py"  # a traceback names the page's line
            (work / name).write_text(block.body)
            lines.append(f"python {name}")
            continue
        for command in commands(block.body):
            plain = bare(command)
            if overrides is not None and plain in overrides:
                lines += overrides[plain]
                continue
            lines.append(command)
            if plain.endswith("&"):
                port = re.search(r"--port[ =](\d+)", plain)
                if port is None:
                    raise ValueError(f"a background command must name its --port: {command}")
                lines.append(f"__doc_wait {port.group(1)} $!")
    return "\n".join(lines)


def run_script(text: str, work: Path, timeout_s: float, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """Run a :func:`script` in ``work``; returns (exit status, stdout, stderr).

    The script runs in a session of its own: past ``timeout_s`` it is killed together with the
    servers it started in the background (its EXIT trap does not run on SIGKILL), freeing their
    ports, and the exit status is -9.
    """
    with subprocess.Popen(["bash", "-c", text], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True, env=None if env is None else dict(env)) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            return -signal.SIGKILL, stdout, stderr + f"\n(killed after {timeout_s:.0f} s)"
    return proc.returncode, stdout, stderr


def scratch_checkout(work: Path) -> Path:
    """``work`` set up as a scratch copy of the repository root: ``.venv``, ``.cache`` and ``examples`` are the
    repository's own."""
    work.mkdir(parents=True, exist_ok=True)
    (ROOT / ".cache").mkdir(exist_ok=True)
    for name in (".venv", ".cache", "examples"):
        (work / name).symlink_to(ROOT / name)
    return work
