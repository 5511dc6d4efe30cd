"""Run untrusted Python in a resource-limited subprocess (used by ``python_exec``).

Limits: CPU seconds, address space, output bytes (stdout + stderr go to a size-limited file) and
wall-clock time (the whole process group is killed), in a fresh temporary directory deleted
afterwards, with an empty environment and Python's isolated mode. An audit hook, installed before
the code runs and impossible to remove from Python, refuses sockets (no network), subprocesses,
signals to other processes, ctypes, and file writes outside the temporary directory.

This is defence in depth for model-written code, not a security boundary against a determined
attacker: for that, run the env server in a container or VM.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile

# Runs in the child before the user's code: set the limits, then install the audit hook.
_PRELUDE = r"""
import os, resource, signal, sys
cpu, memory, output = (int(a) for a in sys.argv[1:4])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory),
                     (resource.RLIMIT_FSIZE, output), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the output limit fail instead of killing
root = os.getcwd()
denied = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty",
          "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.", "pty.")
writes = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
          "os.symlink", "os.link", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
def inside(path, realpath=os.path.realpath, fsdecode=os.fsdecode, prefix=root + os.sep):
    try:
        return realpath(fsdecode(path)).startswith(prefix)
    except (TypeError, ValueError):
        return isinstance(path, int)  # an already-open file descriptor
def guard(event, args):
    if event.startswith(denied):
        raise PermissionError(f"{event} is not allowed in this sandbox")
    if event == "open" and args[1] not in (None, "r", "rb", "rt") and not inside(args[0]):
        raise PermissionError(f"writing {args[0]!r} is not allowed outside the working directory")
    if event in writes and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
        raise PermissionError(f"{event} outside the working directory is not allowed")
sys.addaudithook(guard)
del resource, signal, cpu, memory, output, limit, value
sys.argv = ["main.py"]
import runpy
runpy.run_path("main.py", run_name="__main__")
"""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one run.

    Attributes:
        cpu_seconds: CPU time (RLIMIT_CPU); the process is killed past it.
        memory_bytes: Address space (RLIMIT_AS); allocations past it raise ``MemoryError``.
        output_bytes: Bytes of stdout + stderr kept; more is cut (and further writes fail).
        wall_seconds: Wall-clock time before the process group is killed.
    """

    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    output_bytes: int = 16 << 10
    wall_seconds: float = 10.0


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What a run produced.

    Attributes:
        output: stdout and stderr interleaved, cut at ``Limits.output_bytes``.
        exit_code: The process's exit status (negative: killed by that signal).
        timed_out: Whether the wall-clock limit killed it.
    """

    output: str
    exit_code: int
    timed_out: bool

    @property
    def ok(self) -> bool:
        """Whether the code ran to completion without an error."""
        return self.exit_code == 0 and not self.timed_out


def run_python(code: str, limits: Limits = Limits()) -> RunResult:
    """Run ``code`` as a script in a fresh sandboxed interpreter and collect its output."""
    with tempfile.TemporaryDirectory(prefix="toolgym-py-") as workdir:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as script:
            script.write(code)
        out_path = os.path.join(workdir, ".output")
        with open(out_path, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-I", "-c", _PRELUDE, str(limits.cpu_seconds), str(limits.memory_bytes),
                 str(limits.output_bytes + 1)],  # one byte more than kept, to tell a cut
                cwd=workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
                start_new_session=True,
            )
            try:
                exit_code, timed_out = process.wait(timeout=limits.wall_seconds), False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                exit_code, timed_out = process.wait(), True
        with open(out_path, "rb") as out:
            data = out.read(limits.output_bytes + 1)
    output = data[: limits.output_bytes].decode("utf-8", errors="replace")
    if len(data) > limits.output_bytes:
        output += "\n[output truncated]"
    return RunResult(output, exit_code, timed_out)
