"""The sandbox starts from any layout of the interpreter, and an error that still happens names its real cause.

Each layout runs the sandbox in a subprocess started by that interpreter: a ``.venv`` reached
through a symlink, a venv inside a symlinked folder, the interpreter the venv was made from (a
pyenv or system Python, not a venv), and the system's ``/usr/bin/python3``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from environments.sandbox import IsolationUnavailableError, _bwrap, _core

PROJECT = Path(__file__).resolve().parents[2]
VENV = Path(os.path.realpath(sys.prefix))
IN_A_VENV = sys.prefix != sys.base_prefix
PROBE = """
import json, sys
import environments.python_exec  # checks the sandbox at import, as `toolgym serve python` does
from environments.sandbox import run_python, score_tests
result = run_python("import sys\\nprint(sys.version_info[:2])")
score = score_tests("def f(x):\\n    return x + 1\\n", ["assert f(1) == 2", "assert f(2) == 4"])
print(json.dumps({"output": result.output, "ok": result.ok, "score": score, "prefix": sys.prefix}))
"""


def _run(python: Path, cwd: Path, pythonpath: list[str] | None = None) -> dict[str, object]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if pythonpath is not None:  # an interpreter outside the venv: the project and its packages by path
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    done = subprocess.run([str(python), "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return report


def _packages() -> list[str]:
    return [str(PROJECT), sysconfig.get_paths()["purelib"]]


@pytest.mark.skipif(not IN_A_VENV, reason="the tests run outside a venv")
def test_a_venv_reached_through_a_symlink(tmp_path):
    (tmp_path / "venv").symlink_to(VENV, target_is_directory=True)
    python = tmp_path / "venv" / "bin" / Path(sys.executable).name
    report = _run(python, tmp_path)
    assert report["prefix"] == str(tmp_path / "venv")  # the interpreter really ran as the symlinked venv
    assert report == {**report, "ok": True, "score": 0.5, "output": f"{tuple(sys.version_info[:2])}\n"}


@pytest.mark.skipif(not IN_A_VENV, reason="the tests run outside a venv")
def test_a_venv_inside_a_symlinked_folder(tmp_path):
    (tmp_path / "project").symlink_to(VENV.parent, target_is_directory=True)
    python = tmp_path / "project" / VENV.name / "bin" / Path(sys.executable).name
    report = _run(python, tmp_path)
    assert report["prefix"] == str(tmp_path / "project" / VENV.name)
    assert report == {**report, "ok": True, "score": 0.5, "output": f"{tuple(sys.version_info[:2])}\n"}


def test_the_interpreter_the_venv_was_made_from(tmp_path):
    python = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))  # pyenv's here, or the system's
    report = _run(python, tmp_path, _packages())
    assert report == {**report, "ok": True, "score": 0.5, "output": f"{tuple(sys.version_info[:2])}\n"}


def test_the_system_python(tmp_path):
    system = Path("/usr/bin/python3")
    if not system.exists():
        pytest.skip("no /usr/bin/python3 here")
    version = subprocess.run([str(system), "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    if version != str(tuple(sys.version_info[:2])):
        pytest.skip(f"/usr/bin/python3 is {version}: this venv's compiled packages are not for it")
    report = _run(system, tmp_path, _packages())
    assert report == {**report, "ok": True, "score": 0.5, "output": f"{version}\n"}


def test_an_interpreter_outside_the_sandbox_is_named_with_the_paths_it_sees(monkeypatch):
    _bwrap.read_only_paths()  # the binds, from the real interpreter; then a path none of them holds
    monkeypatch.setattr(_bwrap, "interpreter", lambda: "/nonexistent/bin/python3")
    with pytest.raises(IsolationUnavailableError) as caught:
        _core._check_bwrap()
    message = str(caught.value)
    assert "execvp /nonexistent/bin/python3: No such file or directory" in message
    assert "binds only these host paths" in message and str(VENV) in message
    assert "install" not in message  # bubblewrap is installed: no advice to install it


def test_namespaces_refused_by_the_host_say_so(monkeypatch, tmp_path):
    refusing = tmp_path / "bwrap"
    refusing.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the "
                        "kernel does not allow non-privileged user namespaces' >&2\nexit 1\n")
    refusing.chmod(0o755)
    monkeypatch.setattr(_bwrap, "executable", lambda: str(refusing))
    with pytest.raises(IsolationUnavailableError, match=r"does not let bubblewrap make the namespaces .* Allow "
                                                        r"unprivileged user namespaces") as caught:
        _core._check_bwrap()
    assert str(refusing) in str(caught.value) and "install" not in str(caught.value)
