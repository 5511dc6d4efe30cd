"""The trusted side of grading: runs the tests against a solution served by another process.

Not imported: its source runs as ``python -I [-S] -c SOURCE RESULT_FD`` inside the sandbox, before
any model code, so it imports only the standard library. Its stdin is a JSON object: ``boot`` (the
source of ``_boot.py``), ``boot_config`` (that script's CONFIG, without ``fds``), ``flags`` (the
interpreter's), ``solution`` and ``tests``.

It makes itself non-dumpable and starts the solution in a child interpreter through ``_boot.py``'s
``serve`` mode, which under bubblewrap switches to another uid first: the solution can neither
signal nor trace this process, nor open its ``/proc`` entries and file descriptors. It evaluates
each test here, where the names the solution defines are proxies: a call sends its arguments
(plain literals) to the child and gets back the ``repr`` of the result, read with
``ast.literal_eval`` into plain data. So the solution cannot replace what the tests call, patch
the test code or its builtins, return objects that compare equal to anything, or report a score:
only this process writes to RESULT_FD, once, a JSON object ``{"passed": N, "crashed": bool}``.
The child dying at any time (an exception while loading, an early exit, a kill) is ``crashed``.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import json
import os
import subprocess
import sys
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


def main() -> None:
    """Grade the job on stdin and write the result to the fd named in argv."""
    result_fd = int(sys.argv[1])
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    job = json.loads(sys.stdin.buffer.read())
    requests_read, requests_write = os.pipe()
    answers_read, answers_write = os.pipe()
    config = json.dumps({**job["boot_config"], "fds": [requests_read, answers_write]})
    child = subprocess.Popen([sys.executable, *job["flags"], "-c", job["boot"], config], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # nobody reads it
                             pass_fds=(requests_read, answers_write))
    os.close(requests_read)
    os.close(answers_write)
    try:
        feed = child.stdin
        assert feed is not None  # stdin=PIPE
        feed.write(job["solution"].encode("utf-8", "replace"))
        feed.close()
        passed, crashed = _grade(job, _Channel(requests_write, answers_read)), False
    except (_Crashed, OSError):
        passed, crashed = 0, True
    os.write(result_fd, json.dumps({"passed": passed, "crashed": crashed}).encode())
    os.close(result_fd)
    # No kill: the child has another uid. Under bubblewrap it dies with the sandbox when this
    # process (its PID 1's only child) exits; in weak mode, with the process group.


main()
