"""The env server's Containerfile, checked without building it: what it copies exists and is in the
build context, its entrypoint is the real CLI, its defaults make a server that starts, its health
check asks the served port, and what it installs is what the code imports (``deploy/envserver/``)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from envserver.cli import parse_config
from envserver.exceptions import ServerConfigError
from envserver.registry import parse_specs
from tests.deploy.containerfile import (
    CONTAINERFILE,
    copies,
    exec_form,
    healthcheck_command,
    ignore_allowlist,
    instructions,
    only,
)
from tests.doc_blocks import ROOT

REQUIREMENTS = ROOT / "deploy" / "envserver" / "requirements.txt"
IMAGE_PACKAGES = ("sdk", "envserver", "environments")


def _env(name: str) -> dict[str, str]:
    """The image's ``ENV`` settings (``KEY=value`` pairs, as the Containerfile writes them)."""
    settings: dict[str, str] = {}
    for instruction in instructions():
        if instruction.keyword == "ENV":
            for pair in instruction.args.split():
                key, _, value = pair.partition("=")
                settings[key] = value
    return {name: settings[name]} if name in settings else {}


def _entrypoint() -> tuple[list[str], list[str]]:
    return exec_form(only("ENTRYPOINT").args), exec_form(only("CMD").args)


def _exposed_port() -> int:
    return int(only("EXPOSE").args.split("/")[0])


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    allowed = ignore_allowlist()
    sources = [source for sources, _ in copies() for source in sources]
    assert sources, "the Containerfile copies nothing"
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        assert any(source == a or source.startswith(a.rstrip("/") + "/") for a in allowed), \
            f"COPY {source}: .dockerignore leaves it out of the build context (allowed back: {allowed})"


def test_the_image_holds_exactly_the_env_server_packages_on_its_python_path() -> None:
    python_path = _env("PYTHONPATH")["PYTHONPATH"]
    copied = {source: destination for sources, destination in copies() for source in sources}
    for package in IMAGE_PACKAGES:
        assert copied.get(package) == f"{python_path}/{package}", f"{package}/ is not copied onto {python_path}"
    assert not {"trainer", "toolgym"} & set(copied), "the image is the env server's part only"


def test_the_entrypoint_is_the_env_server_cli_and_its_help_runs() -> None:
    entrypoint, _ = _entrypoint()
    assert entrypoint[:2] == ["python", "-m"], entrypoint
    module = entrypoint[2]
    assert module.split(".")[0] in IMAGE_PACKAGES, f"{module} is not in the image"
    result = subprocess.run([sys.executable, "-m", module, *entrypoint[3:], "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: toolgym serve"), result.stdout[:200]


def test_the_default_command_serves_every_interface_on_the_exposed_port(monkeypatch: pytest.MonkeyPatch) -> None:
    entrypoint, command = _entrypoint()
    monkeypatch.setenv("TOOLGYM_TOKEN", "from-the-environment")
    specs, config, _ = parse_config(entrypoint[3:] + command)
    assert (config.host, config.port, config.token) == ("0.0.0.0", _exposed_port(), "from-the-environment")
    assert sorted(parse_specs(specs)) == sorted(command)  # every default environment loads


def test_the_image_refuses_to_start_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    entrypoint, command = _entrypoint()
    monkeypatch.delenv("TOOLGYM_TOKEN", raising=False)
    with pytest.raises(ServerConfigError, match="no token is set"):
        parse_config(entrypoint[3:] + command)


def test_the_image_runs_as_a_numeric_user_that_is_not_root() -> None:
    user, _, group = only("USER").args.partition(":")
    assert user.isdigit() and int(user) != 0, f"USER {user}: Kubernetes' runAsNonRoot needs a numeric non-zero uid"
    created = " ".join(i.args for i in instructions() if i.keyword == "RUN")
    assert f"--uid {user}" in created and (not group or f"--gid {group}" in created), \
        "USER names a uid (and gid) that no RUN creates"


def test_the_healthcheck_runs_the_copied_script_against_the_served_port() -> None:
    command = healthcheck_command()
    destinations = {destination: sources for sources, destination in copies()}
    script = next(word for word in command if word.endswith(".py"))
    assert script in destinations, f"HEALTHCHECK runs {script}, which no COPY puts there"
    assert (ROOT / destinations[script][0]).is_file()
    url = command[command.index("--url") + 1]
    assert url == f"http://127.0.0.1:{_exposed_port()}"


def test_the_image_requirements_are_pyprojects_own() -> None:
    declared = {Requirement(spec).name.lower(): str(Requirement(spec))
                for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for requirement in _image_requirements():
        theirs = declared.get(requirement.name.lower())
        assert theirs == str(requirement), f"{requirement} in {REQUIREMENTS.name} is {theirs} in pyproject.toml"


def test_the_image_requirements_bring_every_module_level_import() -> None:
    brought = _closure({r.name for r in _image_requirements() if r.marker is None or r.marker.evaluate()})
    missing = {}
    distributions = importlib.metadata.packages_distributions()
    for module, path in _module_level_imports():
        owners = {_normal(name) for name in distributions.get(module, [])}
        if owners and not owners & brought:
            missing[module] = path
    assert not missing, f"imported at module level, installed by no requirement of the image: {missing}"


def _image_requirements() -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _closure(names: set[str]) -> set[str]:
    """The distributions ``names`` bring, with everything they require (no extras), as installed here."""
    todo, seen = [_normal(n) for n in names], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in importlib.metadata.requires(name) or []:
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(_normal(requirement.name))
    return seen


def _module_level_imports() -> list[tuple[str, str]]:
    """(top-level module, file) for each import of the image's packages that runs when its module loads."""
    first_party = set(IMAGE_PACKAGES) | {"trainer", "toolgym", "tests"}
    found = []
    for package in IMAGE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in _top_statements(ast.parse(path.read_text()).body):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in first_party:
                        found.append((top, str(path.relative_to(ROOT))))
    return found


def _top_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements a module runs on import: its body, into ``if``/``try`` blocks, not into functions."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If) and not _is_type_checking(node.test):
            out += _top_statements(node.body) + _top_statements(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_statements(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                out += _top_statements(handler.body)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def test_the_parser_reads_continued_lines_and_refuses_a_dangling_one(tmp_path: Path) -> None:
    good = tmp_path / "Containerfile"
    good.write_text("FROM base\n# note\nRUN a \\\n    # inside\n    && b\nCMD [\"x\"]\n")
    assert [(i.keyword, i.args, i.line) for i in instructions(good)] == [
        ("FROM", "base", 1), ("RUN", "a && b", 3), ("CMD", '["x"]', 6)]
    bad = tmp_path / "Broken"
    bad.write_text("FROM base\nRUN a \\\n")
    with pytest.raises(ValueError, match="line 2 ends in a line continuation"):
        instructions(bad)


def test_the_containerfile_is_where_the_docs_say() -> None:
    assert CONTAINERFILE.relative_to(ROOT).as_posix() in (ROOT / "docs" / "distributed.md").read_text()
