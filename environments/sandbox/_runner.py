"""Start one sandboxed process, collect its capped output, enforce the wall clock, kill what is left."""

from __future__ import annotations

import dataclasses
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Finished:
    """What one process left: its output (at most the cap asked for plus one byte), status, timeout, OOM kills."""

    output: bytes
    exit_code: int
    timed_out: bool
    out_of_memory: bool = False


def execute(argv: Sequence[str], *, stdin: bytes, env: dict[str, str], cwd: str | None, pass_fds: Sequence[int],
            output_cap: int, wall_seconds: float, started: Callable[[float], None] | None = None) -> Finished:
    """Run ``argv`` in a new session with ``stdin`` as its input and stdout + stderr on one pipe.

    ``started(deadline)`` runs once the process exists (bubblewrap's uid maps); if it raises
    ``OSError``, the process is killed and its output so far returned.

    The output is read while the process runs and the pipe is closed once ``output_cap`` bytes came
    (further writes fail); at ``wall_seconds`` the process group is killed. Either way the group is
    killed before returning (under bubblewrap the sandbox's PID namespace takes every process of
    the run with it; without it, a child that left the session survives).
    """
    deadline = time.monotonic() + wall_seconds
    stdin_fd = memfd(stdin)
    read_end, write_end = os.pipe()
    try:
        process = subprocess.Popen(argv, stdin=stdin_fd, stdout=write_end, stderr=write_end, env=env, cwd=cwd,
                                   pass_fds=pass_fds, start_new_session=True)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
        os.close(stdin_fd)
    try:
        if started is not None:
            try:
                started(deadline)
            except OSError:
                os.killpg(process.pid, signal.SIGKILL)
        output, timed_out = _collect(process, read_end, output_cap, deadline)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # not reaped yet, so the group id is still ours
        except ProcessLookupError:
            pass
        exit_code = process.wait()
    return Finished(output, exit_code, timed_out)


def memfd(data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, positioned at its start (close-on-exec)."""
    fd = os.memfd_create("toolgym-sandbox")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _collect(process: subprocess.Popen[bytes], read_end: int, cap: int, deadline: float) -> tuple[bytes, bool]:
    """Read ``read_end`` (which this closes) until the process exits or the deadline passes."""
    data = bytearray()
    pidfd = os.pidfd_open(process.pid)
    with selectors.DefaultSelector() as selector:
        selector.register(pidfd, selectors.EVENT_READ)
        selector.register(read_end, selectors.EVENT_READ)
        reading = True
        try:
            while True:
                remaining = deadline - time.monotonic()
                events = selector.select(remaining) if remaining > 0 else []
                if not events:
                    return bytes(data), True
                if any(key.fd == pidfd for key, _ in events):
                    if reading:
                        os.set_blocking(read_end, False)  # what is buffered; a straggler may hold the pipe open
                        _drain(read_end, data, cap)
                    return bytes(data), False
                chunk = os.read(read_end, 1 << 16)
                data += chunk[: cap - len(data)]
                if not chunk or len(data) >= cap:
                    selector.unregister(read_end)
                    os.close(read_end)
                    reading = False
        finally:
            os.close(pidfd)
            if reading:
                os.close(read_end)


def _drain(fd: int, data: bytearray, cap: int) -> None:
    while len(data) < cap:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            return
        data += chunk[: cap - len(data)]
