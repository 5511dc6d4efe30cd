"""The family registry: names, recognition from a chat template, a user's own family; and family
knowledge stays in ``trainer/families``."""

from __future__ import annotations

import ast
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import trainer.families.registry as registry
from trainer.exceptions import ConfigError
from trainer.families import (
    QWEN3,
    Family,
    ToolCall,
    families,
    family_for,
    family_named,
    register_family,
    template_text,
)

ROOT = Path(__file__).resolve().parents[3]


def test_family_named_suggests_the_closest_name() -> None:
    assert family_named("qwen3_5").title.startswith("Qwen3.5")
    with pytest.raises(ConfigError, match=r"named 'qwen35'\. Did you mean 'qwen3_5'\?.*register_family"):
        family_named("qwen35")


@pytest.mark.parametrize("family", families(), ids=lambda f: f.name)
def test_each_family_recognises_its_own_templates(family: Family) -> None:
    for filename in {family.training_template, family.kit_template} - {None}:
        assert family_for(template_text(str(filename))) is family, filename


def test_an_unknown_template_is_no_family_and_the_warning_says_what_to_do(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer.families.registry"):
        assert family_for("{{ messages }}") is None
        assert family_for(None, warn=False) is None
    assert "register_family" in caplog.text and "qwen3_5" in caplog.text and "kimi_k2" in caplog.text
    assert caplog.text.count("no known model family") == 1


@dataclass(frozen=True)
class PipeFamily(Family):
    """A made-up format: ``CALL name|{json}`` lines."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> Any:
        import json

        lines = text.splitlines()
        calls = [ToolCall(name=ln[5:].split("|")[0], arguments=json.loads(ln.split("|", 1)[1]))
                 for ln in lines if ln.startswith("CALL ")]
        return "\n".join(ln for ln in lines if not ln.startswith("CALL ")).strip(), calls

    def malformed(self, text: str) -> int:
        return 0

    def format_calls(self, content: str, calls: list[ToolCall]) -> str:
        import json

        return "\n".join([content] + [f"CALL {c['name']}|{json.dumps(c['arguments'])}" for c in calls]).strip()


def test_a_users_family_is_registered_and_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    pipe = PipeFamily(name="pipe", title="Pipe", markers=("<<turn>>", "CALL "), stop_tokens=("<<end>>",))
    assert register_family(pipe) is pipe and families()[-1] is pipe and family_named("pipe") is pipe
    assert family_for("<<turn>>{% if x %}CALL {{ x }}{% endif %}") is pipe
    assert pipe.parse(pipe.format_calls("Hi.", [ToolCall(name="f", arguments={"a": 1})])) == (
        "Hi.", [{"name": "f", "arguments": {"a": 1}}])
    with pytest.raises(ConfigError, match="registered already"):
        register_family(PipeFamily(name="pipe", title="Other", markers=("x",), stop_tokens=("y",)))
    with pytest.raises(ConfigError, match="Family instance"):
        register_family("pipe")  # type: ignore[arg-type]
    assert register_family(PipeFamily(name="qwen3", title="Mine", markers=("x",), stop_tokens=("y",)),
                           replace=True).title == "Mine"
    assert QWEN3 not in families()


# The markers that open a call in each shipped family's format: only trainer/families may write them in code.
CALL_MARKERS = ("<tool_call>", "<function=", "<|python_tag|>", "to=functions.", "[TOOL_CALLS]", "<arg_key>",
                "<|tool_calls_section_begin|>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")


def _code_strings(path: Path) -> list[str]:
    """Every string constant of a module except docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_library_code_outside_the_families_matches_on_a_familys_markers() -> None:
    offenders = []
    for package in ("sdk", "envserver", "environments", "trainer", "toolgym"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "families" in path.relative_to(ROOT).parts:
                continue
            found = {m for s in _code_strings(path) for m in CALL_MARKERS if m in s}
            if found:
                offenders.append(f"{path.relative_to(ROOT)}: {sorted(found)}")
    assert not offenders, offenders
