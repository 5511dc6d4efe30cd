"""Start, wait for and stop an env server as a child process (``python -m envserver.cli SPECS``).

Used by ``launch_envserver`` (:mod:`trainer.launch.for_run`), the demo, the benchmarks and the fault tests::

    with EnvServerProcess(["my_envs.counter:CounterEnv"]) as server:
        factory = remote_factory(server.url, "CounterEnv")
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import TracebackType

from trainer.exceptions import EnvServerLaunchError
from trainer.launch.readiness import wait_healthy
from trainer.launch.vllm_server import child_preexec, free_port


class EnvServerProcess:
    """An env server hosting ``specs`` in a child process, on loopback.

    Args:
        specs: What ``toolgym serve`` takes (``module:Class``, ``NAME=module:Class``, bundled names).
        port: TCP port; a free one when ``None``.
        args: More ``toolgym serve`` flags (``["--resume_grace", "30"]``).
        env: Extra environment variables for the process.
        cwd: Its working directory (found modules are looked up there too).
        ready_timeout_s: Seconds to wait for ``/health``.
        quiet: Send its output to ``/dev/null`` (else it shares the caller's).
    """

    def __init__(self, specs: Sequence[str], port: int | None = None, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, cwd: str | None = None, ready_timeout_s: float = 60.0,
                 quiet: bool = False) -> None:
        self.specs = list(specs)
        self.port = port or free_port()
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.ready_timeout_s = ready_timeout_s
        self.quiet = quiet
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's base URL (``http://127.0.0.1:PORT``)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EnvServerProcess:
        """Start the process and wait until ``/health`` answers; :class:`EnvServerLaunchError` if it does not."""
        output = subprocess.DEVNULL if self.quiet else None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "envserver.cli", *self.specs, "--port", str(self.port), "--log_level", "warning",
             *self.args], cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
            preexec_fn=child_preexec())
        problem = wait_healthy(f"{self.url}/health", self.ready_timeout_s, self.process)
        if problem is not None:
            self.stop()
            raise EnvServerLaunchError(f"the env server for {' '.join(self.specs)} {problem}")
        return self

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the process (a crash, for fault tests); idempotent."""
        if self.alive():
            assert self.process is not None
            self.process.kill()
            self.process.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the server drains), SIGKILL after ``timeout_s``; idempotent."""
        if self.alive():
            assert self.process is not None
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> EnvServerProcess:
        return self.start() if self.process is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
