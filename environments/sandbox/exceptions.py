"""Errors of the sandbox, under the project-wide base.

The tree::

    ToolgymError
    └── SandboxError
        ├── IsolationUnavailableError   no working OS isolation (bubblewrap) and no weak-mode opt-in
        └── SandboxConfigError          a bad ``TOOLGYM_SANDBOX`` value or ``Limits`` field

A run whose code fails, times out or is killed raises nothing: that is in its ``RunResult``.
"""

from __future__ import annotations

from sdk.exceptions import ToolgymError


class SandboxError(ToolgymError):
    """Base class of the sandbox's errors."""


class IsolationUnavailableError(SandboxError, RuntimeError):
    """The sandbox cannot isolate code here (bubblewrap missing or not working) and weak mode was not chosen."""


class SandboxConfigError(SandboxError, ValueError):
    """A sandbox setting has a value the sandbox cannot run with."""
