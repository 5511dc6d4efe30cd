"""The ``toolgym`` dispatcher: targets next to the working directory, and SIGTERM unwinding."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sdk.loading import load_target

REPO = Path(__file__).resolve().parents[2]


def test_target_module_in_the_working_directory_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As under a console script: neither "" nor the working directory is on sys.path.
    (tmp_path / "toolgym_cwd_probe_env.py").write_text("class ProbeEnv:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "toolgym_cwd_probe_env", raising=False)
    assert load_target("toolgym_cwd_probe_env:ProbeEnv").__name__ == "ProbeEnv"


def test_sigterm_unwinds_with_blocks(tmp_path: Path) -> None:
    marker = tmp_path / "stopped"
    script = textwrap.dedent(f"""
        import contextlib, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from toolgym.cli import exit_on_sigterm

        @contextlib.contextmanager
        def server():
            try:
                yield
            finally:
                open({str(marker)!r}, "w").write("stopped")

        exit_on_sigterm()
        with server():
            print("ready", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert marker.read_text() == "stopped"
