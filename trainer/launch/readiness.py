"""One readiness poll for every server a launcher starts: ``GET /health`` until it answers 200."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request

POLL_S = 0.2


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen[bytes] | None = None) -> str | None:
    """Poll ``url`` until it answers 200, the process exits, or ``timeout_s`` passes.

    Args:
        url: The health route (``http://127.0.0.1:8000/health``).
        timeout_s: Seconds to wait at most.
        process: The server's process: its exit ends the wait at once.

    Returns:
        ``None`` once healthy, else why not (``"exited with code 1"``, ``"not ready after 60 s (...)"``);
        the caller raises its own typed error with the server's log.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if process is not None and (code := process.poll()) is not None:
            return f"exited with code {code} before it was ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return None
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = repr(exc)
        if time.monotonic() > deadline:
            return f"not ready after {timeout_s:.0f} s ({last})"
        time.sleep(POLL_S)
