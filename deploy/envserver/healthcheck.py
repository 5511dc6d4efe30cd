"""Exit 0 when the env server answers ``GET /health`` with 200, 1 otherwise (refused, 401, 503, timeout).

The image's ``HEALTHCHECK`` and the Kubernetes readiness probe run it inside the container::

    python /opt/toolgym/healthcheck.py [--url http://127.0.0.1:8765] [--timeout 3]

``/health`` is behind the bearer token when the server has one (``envserver/app.py``), and a probe
cannot read a Secret itself, so the token comes from ``TOOLGYM_TOKEN``, the variable ``toolgym serve``
reads it from. 200 means the server would admit a new session; 503 (full or draining) is "not ready",
which is what a readiness probe wants and a liveness probe does not. Standard library only: it runs
in the image, beside the server, without importing the project.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request


def check(url: str, token: str | None, timeout: float) -> tuple[bool, str]:
    """GET ``url``/health with ``token`` as a bearer token: (whether it answered 200, what happened)."""
    request = urllib.request.Request(url.rstrip("/") + "/health")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status == 200, f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:  # 401 (wrong or no token), 503 (full or draining)
        return False, f"HTTP {exc.code}"
    except OSError as exc:  # refused, unreachable, timed out (URLError is an OSError)
        return False, f"unreachable: {exc}"


def main(argv: list[str]) -> int:
    """Check once; print the outcome on failure; returns the exit status (0 ready, 1 not)."""
    parser = argparse.ArgumentParser(prog="healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8765", help="the env server's base URL")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    ok, outcome = check(args.url, os.environ.get("TOOLGYM_TOKEN") or None, args.timeout)
    if not ok:
        print(f"{args.url}/health: {outcome}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
