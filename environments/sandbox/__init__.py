"""Run model-written Python isolated by the operating system, and grade it so that it cannot cheat.

``run_python`` runs a program in a fresh interpreter inside a bubblewrap sandbox (new user, mount,
PID, network, IPC namespaces; uid 65534 without capabilities; a read-only view of the interpreter
only; a size-capped tmpfs work directory; a seccomp filter; rlimits on CPU, memory, file size, open
files and processes; a memory cgroup per run where the server can make one; a wall clock after which
every process of the run is killed). ``score_tests`` grades a solution against ``assert`` tests
evaluated outside the solution's process. Without a working
bubblewrap both raise ``IsolationUnavailableError``, unless ``TOOLGYM_SANDBOX=weak`` chooses the
old audit-hook subprocess, which is not a security boundary (a warning says so when it is chosen).
docs/environments.md has the details.
"""

from __future__ import annotations

from environments.sandbox._core import (
    DEFAULT_LIMITS,
    MODE_VARIABLE,
    Isolation,
    Limits,
    RunResult,
    isolation,
    memory_ceiling,
    run_python,
)
from environments.sandbox.exceptions import IsolationUnavailableError, SandboxConfigError, SandboxError
from environments.sandbox.grading import score_tests

__all__ = [
    "DEFAULT_LIMITS",
    "MODE_VARIABLE",
    "Isolation",
    "IsolationUnavailableError",
    "Limits",
    "RunResult",
    "SandboxConfigError",
    "SandboxError",
    "isolation",
    "memory_ceiling",
    "run_python",
    "score_tests",
]
