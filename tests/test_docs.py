"""The Python and shell blocks of ``docs/*.md`` run as written, by the README's rules (``tests/doc_blocks.py``).

Each page's blocks run in the page's order in one bash session, from a scratch copy of the repository
root, with the project's venv first on ``PATH`` (as after ``source .venv/bin/activate``). A page that
starts a vLLM server (``toolgym vllm``, or a script with ``launch_vllm=True``) is in the vLLM tier; it
serves the model ``make demo`` builds.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from environments import BUNDLED
from tests.doc_blocks import ROOT, bare, blocks, commands, run_script, scratch_checkout, script

DOCS = sorted((ROOT / "docs").glob("*.md"))
STARTS_VLLM = ("toolgym vllm", "vllm serve")


def _starts_vllm(page: Path) -> bool:
    """A bash block starts a server, or a script launches one for its run (``launch_vllm=True``)."""
    return any(bare(command).startswith(STARTS_VLLM)
               for block in blocks(page) if block.runs and block.lang == "bash" for command in commands(block.body)) \
        or any("launch_vllm=True" in block.body for block in blocks(page) if block.runs and block.lang == "python")


def _pages() -> Iterator[object]:
    for page in DOCS:
        if any(block.runs for block in blocks(page)):
            marks = [pytest.mark.vllm, pytest.mark.timeout(1200)] if _starts_vllm(page) else []
            yield pytest.param(page, id=page.name, marks=marks)


@pytest.mark.parametrize("page", _pages())
def test_every_block_of_the_page_runs_as_written(page: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if _starts_vllm(page):
        request.getfixturevalue("warm_counter_model_dir")  # built once in .cache/, as make demo does
    work = scratch_checkout(tmp_path / "checkout")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    returncode, stdout, stderr = run_script(script(blocks(page), work), work, timeout_s=1100, env=env)
    assert returncode == 0, f"{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}"


def test_the_bundled_table_lists_every_bundled_environment() -> None:
    rows = re.findall(r"^\| `(\w+)` \| `([\w.:]+)` \|", (ROOT / "docs" / "environments.md").read_text(), re.M)
    assert dict(rows) == BUNDLED
