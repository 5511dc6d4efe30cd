"""The env server's Containerfile read as its instructions, for the tests of ``deploy/``.

Only what the tests ask is parsed: one instruction per logical line (``\\``-continued lines joined,
comment lines dropped), its keyword upper-cased and its arguments as written; the exec (JSON) form
of ``ENTRYPOINT``, ``CMD`` and ``HEALTHCHECK ... CMD`` as argument lists.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.doc_blocks import ROOT

CONTAINERFILE = ROOT / "deploy" / "envserver" / "Containerfile"
IGNORE_FILE = ROOT / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    """One instruction: ``keyword`` (``COPY``), ``args`` (the rest of the logical line) and its first line."""

    keyword: str
    args: str
    line: int


def instructions(path: Path = CONTAINERFILE) -> list[Instruction]:
    """The file's instructions in order."""
    found: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if not pending:
            start = number
        pending.append(stripped.removesuffix("\\").strip())
        if not stripped.endswith("\\"):
            keyword, _, args = " ".join(part for part in pending if part).partition(" ")
            found.append(Instruction(keyword.upper(), args.strip(), start))
            pending = []
    if pending:
        raise ValueError(f"{path}: the instruction at line {start} ends in a line continuation")
    return found


def only(keyword: str, path: Path = CONTAINERFILE) -> Instruction:
    """The file's single ``keyword`` instruction; fails if there is none or more than one."""
    matches = [i for i in instructions(path) if i.keyword == keyword]
    if len(matches) != 1:
        raise AssertionError(f"{path.name}: expected one {keyword}, found {len(matches)}")
    return matches[0]


def exec_form(args: str) -> list[str]:
    """A JSON-array argument (``["python", "-m", ...]``) as a list; the shell form is refused."""
    value = json.loads(args)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise AssertionError(f"not an exec-form (JSON array of strings) argument: {args}")
    return value


def copies(path: Path = CONTAINERFILE) -> list[tuple[list[str], str]]:
    """Each build-context ``COPY`` as (sources, destination); a ``COPY --from`` (another stage) is left out."""
    found = []
    for instruction in instructions(path):
        if instruction.keyword != "COPY":
            continue
        words = shlex.split(instruction.args)
        if any(word.startswith("--from") for word in words):
            continue
        words = [word for word in words if not word.startswith("--")]
        found.append((words[:-1], words[-1]))
    return found


def healthcheck_command(path: Path = CONTAINERFILE) -> list[str]:
    """The ``HEALTHCHECK``'s command, from its exec-form ``CMD``."""
    args = only("HEALTHCHECK", path).args
    match = re.search(r"\bCMD\s+(\[.*\])\s*$", args)
    if match is None:
        raise AssertionError(f"HEALTHCHECK without an exec-form CMD: {args}")
    return exec_form(match.group(1))


def ignore_allowlist(path: Path = IGNORE_FILE) -> list[str]:
    """The paths an ignore file that starts with ``*`` lets back into the build context (its ``!`` lines)."""
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    if not lines or lines[0] != "*":
        raise AssertionError(f"{path.name} must start by leaving everything out ('*'), then allow paths back")
    return [line[1:] for line in lines if line.startswith("!")]
