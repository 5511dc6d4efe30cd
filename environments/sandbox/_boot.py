"""First code of every interpreter that runs model-written code: limits, then the code.

Not imported: its source runs as ``python -I [-S] -c SOURCE CONFIG`` in the sandbox, so it imports
only the standard library, and as little of it as it can (each import costs every run's start).
CONFIG is the hex of a ``marshal``-ed dict written by ``_core.boot_config`` (trusted): ``path``
(directories added to ``sys.path``: the host's site-packages where ``site`` does not run), ``cpu``,
``memory``, ``file``, ``files`` (rlimits; ``file`` caps each written file, ``files`` open
descriptors), ``processes`` and ``signals`` (RLIMIT_NPROC and RLIMIT_SIGPENDING, counted per user,
or None where the run shares the host's uid), ``user`` (the uid and gid to switch to, or None),
``hook`` (install the weak mode's audit hook), ``mode`` and, in ``serve`` mode, ``fds``.

The code arrives on stdin (then stdin is /dev/null). Mode ``run`` writes it to ``main.py`` and runs
it as ``__main__``. Mode ``serve`` writes it to ``solution.py``, runs it as module ``solution`` and
answers a grader's calls to its public callables on two pipe fds (``_grader.py`` holds the other
ends): frames of a 4-byte big-endian length and a ``repr``; the first frame lists the callables,
each answer is ``("ok", repr(result))`` or ``("error", "ExceptionName", message)``.
"""

from __future__ import annotations

import marshal
import os
import resource
import signal
import sys

MYPY = False
if MYPY:  # typing costs ~9 ms to import
    from typing import Any

_HOOK_DENIED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty",
                "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.", "pty.")
_HOOK_WRITES = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
                "os.symlink", "os.link", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}


def _limit(config: dict[str, Any]) -> None:
    for which, value in ((resource.RLIMIT_CPU, config["cpu"]), (resource.RLIMIT_AS, config["memory"]),
                         (resource.RLIMIT_FSIZE, config["file"]), (resource.RLIMIT_NOFILE, config["files"]),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_SIGPENDING, config["signals"]),
                         (resource.RLIMIT_NPROC, config["processes"])):
        if value is not None:
            resource.setrlimit(which, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file limit fails instead of killing


def _install_hook() -> None:
    """The weak mode's guard (the old sandbox): Python-level only, see the package docstring."""
    prefix = os.getcwd() + os.sep

    def inside(path: object) -> bool:
        try:
            return os.path.realpath(os.fsdecode(path)).startswith(prefix)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return isinstance(path, int)  # an already-open file descriptor

    def guard(event: str, args: tuple[Any, ...]) -> None:
        if event.startswith(_HOOK_DENIED):
            raise PermissionError(f"{event} is not allowed in this sandbox")
        if event == "open" and args[1] not in (None, "r", "rb", "rt") and not inside(args[0]):
            raise PermissionError(f"writing {args[0]!r} is not allowed outside the working directory")
        if event in _HOOK_WRITES and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
            raise PermissionError(f"{event} outside the working directory is not allowed")

    sys.addaudithook(guard)


def _send(fd: int, text: str) -> None:
    data = text.encode("utf-8", "backslashreplace")
    frame = len(data).to_bytes(4, "big") + data
    while frame:
        frame = frame[os.write(fd, frame):]


def _receive(fd: int) -> str | None:
    """One frame's text, or None at end of input."""
    header = _read_exactly(fd, 4)
    body = None if header is None else _read_exactly(fd, int.from_bytes(header, "big"))
    return None if body is None else body.decode()


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _serve(code: str, requests: int, answers: int) -> None:
    import ast  # here: ~10 ms that a plain run does not need
    namespace: dict[str, Any] = {"__name__": "solution", "__file__": "solution.py"}
    exec(compile(code, "solution.py", "exec"), namespace)  # an exception here ends the process: a crash
    names = sorted(name for name, value in namespace.items() if not name.startswith("_") and callable(value))
    _send(answers, repr(names))
    while (request := _receive(requests)) is not None:
        name, args, kwargs = ast.literal_eval(request)
        try:
            _send(answers, repr(("ok", repr(namespace[name](*args, **kwargs)))))
        except Exception as exc:  # the test sees it raised in the grader
            _send(answers, repr(("error", type(exc).__name__, str(exc)[:1000])))


def main() -> None:
    """Set the limits and run the code from stdin as CONFIG says."""
    config = marshal.loads(bytes.fromhex(sys.argv[1]))
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    keep = config.get("fds", [])
    low = 3  # close every other inherited descriptor
    for fd in [*sorted(keep), os.sysconf("SC_OPEN_MAX")]:
        os.closerange(low, fd)
        low = fd + 1
    script = "main.py" if config["mode"] == "run" else "solution.py"
    with open(script, "w", encoding="utf-8") as out:
        out.write(code)
    if config["user"] is not None:  # the last step as the sandbox's root: from here on, no capabilities
        os.setgroups([])
        os.setresgid(config["user"], config["user"], config["user"])
        os.setresuid(config["user"], config["user"], config["user"])
    _limit(config)
    if config["hook"]:
        _install_hook()
    sys.path.extend(config["path"])
    sys.argv = [script]
    if config["mode"] == "run":  # what runpy.run_path does, without its ~25 ms of imports
        path = os.path.abspath(script)
        module = type(sys)("__main__")
        module.__file__ = path
        sys.modules["__main__"] = module
        exec(compile(code, path, "exec"), vars(module))
    else:
        _serve(code, *keep)


if __name__ == "__main__":  # as ``python -c SOURCE``; importing it runs nothing
    main()
