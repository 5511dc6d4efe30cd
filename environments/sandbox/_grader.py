"""The trusted side of grading: runs the tests against a solution served by another process.

Not imported: its source runs as ``python -I [-S] -c SOURCE RESULT_FD`` inside the sandbox, before
any model code, so it imports only the standard library (and little of it: each import costs every
grading). Its stdin is a ``marshal``-ed dict from ``grading.score_tests`` (trusted): ``boot`` (the
source of ``_boot.py``), ``boot_config`` (that script's CONFIG, without ``fds``), ``flags`` (the
interpreter's), ``solution``, ``tests`` and ``nonce``.

It starts the solution in a child interpreter through ``_boot.py``'s ``serve`` mode, which under
bubblewrap started by root switches to another uid first (otherwise this process makes itself
non-dumpable): the solution can neither signal nor trace this process, nor open its ``/proc``
entries and file descriptors. It evaluates
each test here, where the names the solution defines are proxies: a call sends its arguments
(plain literals) to the child and gets back the ``repr`` of the result, read with
``ast.literal_eval`` into plain data. So the solution cannot replace what the tests call, patch
the test code or its builtins, return objects that compare equal to anything, or report a score:
only this process writes to RESULT_FD, once: ``b"NONCE PASSED CRASHED"`` (the job's ``nonce``, then
two integers, CRASHED 0 or 1).
The child dying at any time (an exception while loading, an early exit, a kill) is ``crashed``.
"""

from __future__ import annotations

import ast
import builtins
import marshal
import os
import sys

MYPY = False
if MYPY:  # typing costs ~9 ms to import
    from typing import Any

_MAX_FRAME = 1 << 20
_PR_SET_DUMPABLE = 4


class _Crashed(Exception):
    """The solution's process died or broke the protocol."""


class _Channel:
    """The pipes to the solution's process."""

    def __init__(self, requests: int, answers: int) -> None:
        self.requests, self.answers = requests, answers

    def send(self, text: str) -> None:
        data = text.encode()
        frame = len(data).to_bytes(4, "big") + data
        try:
            while frame:
                frame = frame[os.write(self.requests, frame):]
        except OSError as exc:
            raise _Crashed from exc

    def receive(self) -> Any:
        size = int.from_bytes(self._read(4), "big")
        if size > _MAX_FRAME:
            raise _Crashed
        try:
            return ast.literal_eval(self._read(size).decode())
        except (ValueError, SyntaxError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
            raise _Crashed from exc

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = os.read(self.answers, size - len(data))
            if not chunk:
                raise _Crashed
            data += chunk
        return data


class _Remote:
    """Stands for one of the solution's callables: calling it calls that in the solution's process."""

    def __init__(self, channel: _Channel, name: str) -> None:
        self._channel, self._name = channel, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = repr((self._name, args, kwargs))
        if ast.literal_eval(request) != (self._name, args, kwargs):
            raise TypeError(f"{self._name}(): arguments must be plain literals")
        self._channel.send(request)
        answer = self._channel.receive()
        if not isinstance(answer, tuple) or not answer or answer[0] not in ("ok", "error"):
            raise _Crashed
        if answer[0] == "ok" and len(answer) == 2 and isinstance(answer[1], str):
            try:
                return ast.literal_eval(answer[1])
            except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
                raise TypeError(f"{self._name}() returned a value that is not plain data") from exc
        kind = getattr(builtins, str(answer[1]), None) if len(answer) == 3 else None
        error = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
        raise error(str(answer[-1]))


def _grade(job: dict[str, Any], channel: _Channel) -> int:
    names = channel.receive()
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _Crashed
    # A builtin's name stays the builtin's: the solution's own len() or AssertionError is not seen.
    namespace = {name: _Remote(channel, name) for name in names if not hasattr(builtins, name)}
    passed = 0
    for test in job["tests"]:
        try:
            exec(compile(test, "<test>", "exec"), namespace)
            passed += 1
        except _Crashed:
            raise
        except Exception:  # a failed assertion, or anything else the test raised
            pass
    return passed


def _spawn(job: dict[str, Any], requests: int, answers: int) -> int:
    """Start the solution's interpreter (``_boot.py`` serve mode); returns the write end of its stdin.

    ``os.posix_spawn``, not ``subprocess`` (~15 ms of imports): only the fds made inheritable here
    and the dup2-ed stdio reach the child.
    """
    config = marshal.dumps({**job["boot_config"], "fds": [requests, answers]}).hex()
    stdin_read, stdin_write = os.pipe()
    devnull = os.open(os.devnull, os.O_WRONLY)  # nobody reads what the solution prints
    for fd in (requests, answers):
        os.set_inheritable(fd, True)
    os.posix_spawn(sys.executable, [sys.executable, *job["flags"], "-c", job["boot"], config], dict(os.environ),
                   file_actions=[(os.POSIX_SPAWN_DUP2, stdin_read, 0), (os.POSIX_SPAWN_DUP2, devnull, 1),
                                 (os.POSIX_SPAWN_DUP2, devnull, 2)])
    for fd in (stdin_read, devnull, requests, answers):
        os.close(fd)
    return stdin_write


def main() -> None:
    """Grade the job on stdin and write the result to the fd named in argv."""
    result_fd = int(sys.argv[1])
    os.set_inheritable(result_fd, False)  # it came inherited: the solution's interpreter must not get it
    job = marshal.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the job (with its nonce) is not left readable
    if job["boot_config"]["user"] is None:
        # The solution keeps this process's uid: without this it could open /proc/<this>/fd/RESULT_FD.
        import ctypes
        ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    requests_read, requests_write = os.pipe()
    answers_read, answers_write = os.pipe()
    feed = _spawn(job, requests_read, answers_write)
    try:
        data = memoryview(job["solution"].encode("utf-8", "replace"))
        while data:
            data = data[os.write(feed, data):]
        os.close(feed)
        passed, crashed = _grade(job, _Channel(requests_write, answers_read)), False
    except (_Crashed, OSError):
        passed, crashed = 0, True
    os.write(result_fd, b"%s %d %d" % (job["nonce"].encode(), passed, crashed))
    os.close(result_fd)
    # No kill: under bubblewrap the child has another uid, and dies with the sandbox when this
    # process (its PID 1's only child) exits; in weak mode, with the process group.


if __name__ == "__main__":  # as ``python -c SOURCE``; importing it runs nothing
    main()
