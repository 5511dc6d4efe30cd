"""The Autobahn WebSocket conformance suite against the server's own protocol (``envserver._websocket``).

Autobahn's fuzzing client (``wstest -m fuzzingclient``, Python 2 code) drives every case but the
performance (9.*) and compression (12.*, 13.*: no extension is negotiated) ones against an echo app
served by uvicorn with ``UpgradeFastPath`` and ``WebSocketProtocol``, exactly as the env server
uses them. It is installed on first use with Python 2.7's pip into ``.cache/autobahn/`` (PyPI only)
and cached there; without a Python 2.7 the test is skipped and says so.

Zero failed cases is the bar; "non-strict" (e.g. a close frame sent later than the suite likes) is
allowed and counted in the printed table.
"""

from __future__ import annotations

import collections
import fcntl
import glob
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from envserver._http import UpgradeFastPath
from envserver._websocket import WebSocketProtocol

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "autobahn"
VERSION = "25.10.1"  # autobahntestsuite on PyPI; it pins its own dependencies (Twisted 19.10, ...)


def _python2() -> str | None:
    """A working Python 2.7: on PATH, else pyenv's (its shim on PATH fails when 2.7 is not selected)."""
    candidates = [shutil.which("python2.7") or ""]
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{root}/versions/2.7*/bin/python2.7"), reverse=True)
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (2, 7)"],
                          capture_output=True).returncode == 0:
            return candidate
    return None


def _install(python2: str) -> Path:
    """``.cache/autobahn/site`` with autobahntestsuite installed in it (once; a lock guards parallel runs)."""
    site = CACHE / f"site-{VERSION}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (site / ".installed").exists():
            shutil.rmtree(site, ignore_errors=True)
            subprocess.run([python2, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                            "--target", str(site), f"autobahntestsuite=={VERSION}"], check=True, timeout=900)
            (site / ".installed").touch()
    return site


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """ASGI app that echoes every WebSocket message back as it came (text or binary)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "websocket":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        if message.get("text") is not None:
            await send({"type": "websocket.send", "text": message["text"]})
        else:
            await send({"type": "websocket.send", "bytes": message["bytes"]})


@pytest.fixture
def echo_server():
    """The echo app under uvicorn with the env server's HTTP and WebSocket protocols, on a free port."""
    server = uvicorn.Server(uvicorn.Config(
        echo_app, host="127.0.0.1", port=0, http=UpgradeFastPath, ws=WebSocketProtocol, log_level="warning",
        ws_max_size=16 << 20, ws_ping_interval=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "echo server did not start"
        time.sleep(0.01)
    yield f"ws://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


@pytest.mark.slow  # the whole Autobahn fuzzing-client suite: about 70 s
def test_autobahn_fuzzingclient_finds_no_failed_case(echo_server, tmp_path):
    python2 = _python2()
    if python2 is None:
        pytest.skip("no Python 2.7 (on PATH or under pyenv): the Autobahn suite is Python 2 code")
    site = _install(python2)
    spec = {"outdir": str(tmp_path / "report"), "servers": [{"agent": "toolgym", "url": echo_server}],
            "cases": ["*"], "exclude-cases": ["9.*", "12.*", "13.*"], "exclude-agent-cases": {}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    # site.addsitedir, not PYTHONPATH: zope is a namespace package declared by a .pth file.
    run = ("import site, sys; site.addsitedir(sys.argv.pop(1)); "
           "from autobahntestsuite.wstest import run; sys.exit(run())")
    subprocess.run([python2, "-c", run, str(site), "-m", "fuzzingclient", "-s", str(tmp_path / "spec.json")],
                   cwd=tmp_path, check=True, timeout=600, capture_output=True)
    results = json.loads((tmp_path / "report" / "index.json").read_text())["toolgym"]
    counts = collections.Counter(result["behavior"] for result in results.values())
    print("autobahn:", dict(counts), "non-strict:",
          sorted(case for case, result in results.items() if result["behavior"] == "NON-STRICT"))
    failed = {case: result for case, result in results.items()
              if "FAILED" in (result["behavior"], result["behaviorClose"])}
    assert not failed, f"failed cases: {sorted(failed)}"
    assert len(results) > 200  # every case ran (247 at this version)
