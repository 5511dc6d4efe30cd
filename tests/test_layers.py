"""The import graph runs one way: each layer imports only the layers below it (docs/architecture.md).

Read from the code (every ``import``, lazy ones inside functions included), so an arrow back up a
layer fails here even when no test happens to execute it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# layer -> the layers it may import (itself included)
ALLOWED: dict[str, set[str]] = {
    "sdk": {"sdk"},
    "environments": {"sdk", "environments"},
    "envserver": {"sdk", "environments", "envserver"},
    # the trainer's top modules: what both of its processes share (config, records, exceptions, ...)
    "trainer.shared": {"sdk", "trainer.shared"},
    # the vLLM server's clients and facts: used by the rollout worker and by the weight sync
    "trainer.vllm": {"trainer.shared", "trainer.vllm"},
    # what the trainer knows of each model family's chat format: used by the rollout worker and the trainers
    "trainer.families": {"trainer.shared", "trainer.families"},
    "trainer.rollout": {"sdk", "trainer.shared", "trainer.vllm", "trainer.families", "trainer.rollout"},
    "trainer.training": {"sdk", "trainer.shared", "trainer.training"},
    "trainer.sync": {"trainer.shared", "trainer.vllm", "trainer.sync"},
    # the servers a run starts (vLLM with the sync's backend, an env server as a child process, never envserver)
    "trainer.launch": {"sdk", "trainer.shared", "trainer.sync", "trainer.launch"},
    "trainer.api": {"sdk", "trainer.shared", "trainer.vllm", "trainer.families", "trainer.rollout", "trainer.training",
                    "trainer.sync", "trainer.launch", "trainer.api"},
    "toolgym": {"sdk", "environments", "envserver", "trainer.shared", "trainer.vllm", "trainer.families",
                "trainer.rollout", "trainer.training", "trainer.sync", "trainer.launch", "trainer.api", "toolgym"},
}
API = {"async_grpo_trainer", "harness_trainer", "construction_checks", "step_callback"}
"""The trainer's top modules that tie every layer together: the trainers, their checks and step callback."""


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (``None`` for third-party modules)."""
    top = module.split(".")[0]
    if top in ("sdk", "environments", "envserver", "toolgym"):
        return top
    if top != "trainer":
        return None
    parts = module.split(".")
    if module == "trainer" or parts[1] in API:  # the public trainers and the package's lazy facade
        return "trainer.api"
    if parts[1] in ("vllm", "families", "rollout", "training", "sync", "launch"):
        return f"trainer.{parts[1]}"
    return "trainer.shared"


def imports_of(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, resolved to absolute dotted names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return found


def library_modules() -> list[tuple[Path, str]]:
    out = []
    for package in ALLOWED:
        if "." in package:
            continue
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.append((path, ".".join(parts)))
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((path, ".".join(parts)))
    return out


@pytest.mark.parametrize("path,module", library_modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_only_go_down(path: Path, module: str) -> None:
    own = layer_of(module)
    assert own is not None
    wrong = sorted(
        m for m in imports_of(path, module) if (layer := layer_of(m)) is not None and layer not in ALLOWED[own]
    )
    assert not wrong, f"{module} ({own}) imports {wrong}, above or beside its layer"


def test_the_training_side_imports_no_client_stack() -> None:
    # The GPU image has torch and transformers but no websockets, aiohttp or gymnasium: the
    # training side (and every package's errors, which derive from sdk.exceptions) must not need them.
    import subprocess
    import sys

    probe = ("import sys, trainer.exceptions, trainer.training.loss, trainer.training.packing, "
             "trainer.training.tree_attention; "
             "print(sorted(m for m in ('websockets', 'aiohttp', 'gymnasium', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
