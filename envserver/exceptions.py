"""Errors raised by the env server's own code (not sent on the wire; those are ``sdk.protocol`` codes).

The tree (all under ``sdk.exceptions.ToolgymError``, the project-wide base)::

    ToolgymError
    └── EnvServerError
        ├── ServerConfigError    a ServerConfig value out of range
        ├── EnvSpecError         an environment spec (``NAME=module:Class``) cannot be loaded
        ├── Refused              (internal) a new session cannot be opened; carries the wire code
        └── SessionBusy          (internal) a timed-out sync call still runs on the session's environment
"""

from __future__ import annotations

from sdk.exceptions import ToolgymError


class EnvServerError(ToolgymError):
    """Base class of the env server's errors."""


class ServerConfigError(EnvServerError, ValueError):
    """A ``ServerConfig`` field has a value the server cannot run with."""


class EnvSpecError(EnvServerError, ValueError):
    """An environment spec names a module or attribute that does not exist or is not usable."""
