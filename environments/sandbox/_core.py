"""Limits, isolation modes and ``run_python``: one sandboxed interpreter per run."""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import marshal
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from environments.sandbox import _bwrap, _cgroup, _seccomp
from environments.sandbox._runner import Finished, execute, memfd
from environments.sandbox.exceptions import IsolationUnavailableError, SandboxConfigError

MODE_VARIABLE = "TOOLGYM_SANDBOX"
_SIGNALS_QUEUED = 64
logger = logging.getLogger("environments.sandbox")
BOOT_SOURCE = (Path(__file__).parent / "_boot.py").read_text(encoding="utf-8")
_WEAK_WARNING = (
    f"{MODE_VARIABLE}=weak: model-written code runs WITHOUT OS isolation (an audit hook only, which code can "
    "get around): it can read this host's files and this server's token and environment, reach the network, "
    "write where this user can and leave processes behind. Use it only on a throwaway host or container."
)


class Isolation(enum.Enum):
    """How a run is isolated.

    ``BWRAP``: bubblewrap namespaces, seccomp and rlimits (``_bwrap``'s docstring lists what the
    code sees); the default. ``WEAK``: the old subprocess with rlimits and an audit hook, in a host
    temporary directory, as the host user; not a security boundary, chosen only explicitly.
    """

    BWRAP = "bwrap"
    WEAK = "weak"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one run.

    Attributes:
        cpu_seconds: CPU time of each process (RLIMIT_CPU); a process is killed past it.
        memory_bytes: Address space of each process (RLIMIT_AS); allocations past it raise ``MemoryError``.
        output_bytes: Bytes of stdout + stderr kept; more is cut and further writes fail.
        wall_seconds: Wall-clock time of the whole run before every process of it is killed.
        processes: Processes and threads the run may have at once (RLIMIT_NPROC in the sandbox's own
            user namespace; the interpreter counts as one). Not enforced in weak mode.
        disk_bytes: Size of the work directory (a tmpfs, counted in memory), and the largest file
            any process may write (RLIMIT_FSIZE, the only disk limit in weak mode).
        open_files: Open file descriptors of each process (RLIMIT_NOFILE), which bounds the kernel
            buffers (pipes, sockets) a process can hold outside a memory cgroup.

    Under bubblewrap, where the server can make a memory cgroup per run, everything the run holds
    (its processes' memory, its files, their kernel memory) is also held to ``memory_bytes +
    disk_bytes`` in all (``memory_ceiling``); docs/environments.md ("Memory") gives the ceiling without one.
    """

    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    output_bytes: int = 16 << 10
    wall_seconds: float = 10.0
    processes: int = 16
    disk_bytes: int = 32 << 20
    open_files: int = 64

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "output_bytes", "wall_seconds", "processes", "disk_bytes",
                     "open_files"):
            if not getattr(self, name) > 0:
                raise SandboxConfigError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What a run produced.

    Attributes:
        output: stdout and stderr interleaved, cut at ``Limits.output_bytes``.
        exit_code: The process's exit status; negative: killed by that signal (under bubblewrap an
            exit status above 128 is read as one, as shells do).
        timed_out: Whether the wall-clock limit killed it.
        out_of_memory: Whether the kernel killed a process of the run for holding more than the run's
            memory ceiling (``memory_ceiling``; only where runs get a memory cgroup).
    """

    output: str
    exit_code: int
    timed_out: bool
    out_of_memory: bool = False

    @property
    def ok(self) -> bool:
        """Whether the code ran to completion without an error (and no process of it was killed for its memory)."""
        return self.exit_code == 0 and not self.timed_out and not self.out_of_memory


DEFAULT_LIMITS = Limits()
"""The limits a run gets when none are given."""


def isolation() -> Isolation:
    """The isolation in force, from ``TOOLGYM_SANDBOX`` (``bwrap``, the default, or ``weak``).

    Checked once per process; choosing weak mode logs a warning naming the risk.

    Raises:
        IsolationUnavailableError: bubblewrap is missing or does not work here, and weak mode was not chosen.
        SandboxConfigError: ``TOOLGYM_SANDBOX`` has another value.
    """
    return _isolation(os.environ.get(MODE_VARIABLE, "") or Isolation.BWRAP.value)


@functools.cache
def _isolation(value: str) -> Isolation:
    try:
        mode = Isolation(value)
    except ValueError:
        raise SandboxConfigError(f"{MODE_VARIABLE}={value!r}: use 'bwrap' (the default) or 'weak'") from None
    if mode is Isolation.WEAK:
        logger.warning(_WEAK_WARNING)
    else:
        _check_bwrap()
    return mode


def _check_bwrap() -> None:
    """Run ``pass`` in a sandbox; raise ``IsolationUnavailableError`` naming what failed and why."""
    bwrap = _bwrap.executable()
    if bwrap is None:
        raise IsolationUnavailableError(
            "the sandbox needs bubblewrap (bwrap), which is not on PATH: install it (Debian/Ubuntu: apt-get install "
            f"bubblewrap; `make setup` does it), or set {MODE_VARIABLE}=weak to run model code without isolation "
            "(unsafe: see docs/environments.md)")
    limits = Limits(wall_seconds=60.0)
    probe = launch(Isolation.BWRAP, limits, BOOT_SOURCE, boot_argument(Isolation.BWRAP, limits, "run"), b"pass\n")
    if probe.exit_code != 0:
        detail = probe.output.decode(errors="replace").strip() or f"exit status {probe.exit_code}, no output"
        raise IsolationUnavailableError(f"bubblewrap ({bwrap}) could not run {_bwrap.interpreter()} in a sandbox: "
                                        f"{detail}{_bwrap.explain(detail)}")


def python_flags(mode: Isolation) -> list[str]:
    """The interpreter's flags: isolated mode; under bubblewrap also no ``site`` (``boot_config`` sets the path).

    ``site`` runs the venv's ``.pth`` files (with an editable install's finder, ~50 ms of a ~75 ms
    start here: bench/sandbox); weak mode keeps the old sandbox's start.
    """
    return ["-I", "-S"] if mode is Isolation.BWRAP else ["-I"]


def boot_config(mode: Isolation, limits: Limits, run_mode: str) -> dict[str, object]:
    """``_boot.py``'s CONFIG for ``limits`` (without ``fds``)."""
    return {"path": _bwrap.site_packages() if mode is Isolation.BWRAP else [],
            "cpu": limits.cpu_seconds, "memory": limits.memory_bytes, "file": limits.disk_bytes,
            "files": limits.open_files,
            # In weak mode the run shares the host uid's counts, so RLIMIT_NPROC would count the host's.
            "processes": limits.processes if mode is Isolation.BWRAP else None,
            # Queued signals, and so POSIX timers (each holds one): the kernel's default lets a run hold ~90,000.
            "signals": _SIGNALS_QUEUED if mode is Isolation.BWRAP else None,
            "hook": mode is Isolation.WEAK,
            "user": _bwrap.UID if mode is Isolation.BWRAP and _bwrap.switches_user() else None,
            "mode": run_mode}


def boot_argument(mode: Isolation, limits: Limits, run_mode: str) -> str:
    """``boot_config`` encoded as ``_boot.py`` reads it (hex of ``marshal``: no import to decode it)."""
    return marshal.dumps(boot_config(mode, limits, run_mode)).hex()


def launch(mode: Isolation, limits: Limits, source: str, argument: str, stdin: bytes,
           pass_fds: Sequence[int] = ()) -> Finished:
    """Run ``python FLAGS -c source argument`` with ``stdin`` as its input, isolated as ``mode``, under ``limits``.

    ``pass_fds`` are inherited (at the same numbers); the process group, and under bubblewrap every
    process of the run, is gone when this returns.
    """
    # Weak mode runs the host's own interpreter as started (its venv's site); a sandbox, the real binary it binds.
    python = [sys.executable if mode is Isolation.WEAK else _bwrap.interpreter(), *python_flags(mode), "-c", source,
              argument]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    cap = limits.output_bytes + 1  # one byte more than kept, to tell a cut
    if mode is Isolation.WEAK:
        with tempfile.TemporaryDirectory(prefix="toolgym-py-") as workdir:
            return execute(python, stdin=stdin, env={**env, "HOME": workdir, "TMPDIR": workdir}, cwd=workdir,
                           pass_fds=pass_fds, output_cap=cap, wall_seconds=limits.wall_seconds)
    bwrap = _bwrap.executable()
    if bwrap is None:
        raise IsolationUnavailableError("bubblewrap (bwrap) is no longer on PATH")
    where = _cgroup.hierarchy()
    cgroup = None if where is None else _run_cgroup(where, limits)
    seccomp = memfd(_seccomp.filter_program())
    startup = _bwrap.Startup(maps_users=_bwrap.switches_user(), cgroup=cgroup)
    try:
        env = {**env, "HOME": _bwrap.WORKDIR, "TMPDIR": _bwrap.WORKDIR}
        argv = _bwrap.command(bwrap, limits.disk_bytes, seccomp, env, startup) + python
        finished = execute(argv, stdin=stdin, env={}, cwd=None, output_cap=cap, wall_seconds=limits.wall_seconds,
                           pass_fds=(seccomp, *startup.fds, *pass_fds), started=startup)
    finally:
        startup.close()
        os.close(seccomp)
        out_of_memory = cgroup is not None and cgroup.close()
    if finished.exit_code > 128:  # bubblewrap reports a child killed by signal N as 128 + N
        finished = dataclasses.replace(finished, exit_code=128 - finished.exit_code)
    if out_of_memory:
        finished = dataclasses.replace(finished, out_of_memory=True)
    return finished


def memory_ceiling(limits: Limits) -> int:
    """The memory a run may hold in all where it gets a memory cgroup: its processes, files and kernel memory."""
    return limits.memory_bytes + limits.disk_bytes


def _run_cgroup(where: _cgroup.Hierarchy, limits: Limits) -> _cgroup.RunCgroup:
    try:
        return _cgroup.RunCgroup(where, memory_ceiling(limits))
    except OSError as exc:
        raise IsolationUnavailableError(f"cannot make the run's memory cgroup: {exc}") from exc


def run_python(code: str, limits: Limits = DEFAULT_LIMITS, mode: Isolation | None = None) -> RunResult:
    """Run ``code`` as a script in a fresh sandboxed interpreter and collect its output.

    Args:
        code: The program; it runs as ``main.py`` in its own work directory.
        limits: Its resource limits.
        mode: The isolation; ``None`` is ``isolation()`` (which raises ``IsolationUnavailableError``
            when bubblewrap cannot run and weak mode was not chosen).
    """
    mode = mode or isolation()
    finished = launch(mode, limits, BOOT_SOURCE, boot_argument(mode, limits, "run"), code.encode("utf-8", "replace"))
    output = finished.output[: limits.output_bytes].decode("utf-8", errors="replace")
    if len(finished.output) > limits.output_bytes:
        output += "\n[output truncated]"
    return RunResult(output, finished.exit_code, finished.timed_out, finished.out_of_memory)
