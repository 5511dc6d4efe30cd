"""The env server: hosts environment classes over WebSocket sessions (``toolgym serve``).

Build one in code with ``EnvServer(parse_specs(["counter"]), ServerConfig(port=8765)).run()``, or
on a background thread with ``ServerThread``; the wire protocol is in ``docs/protocol.md``.
"""

from __future__ import annotations

import warnings
from typing import Any

from envserver.app import create_app
from envserver.config import ServerConfig
from envserver.exceptions import EnvServerError, EnvSpecError, ServerConfigError
from envserver.registry import EnvSpec, parse_specs
from envserver.server import EnvServer, ServerThread

__all__ = [
    "EnvServer",
    "EnvServerError",
    "EnvSpec",
    "EnvSpecError",
    "ServerConfig",
    "ServerConfigError",
    "ServerThread",
    "create_app",
    "parse_specs",
]


def __getattr__(name: str) -> Any:
    if name == "ConfigError":  # renamed: the trainer's ConfigError is another error
        warnings.warn("envserver.ConfigError is deprecated and will be removed in toolgym 0.2: use "
                      "envserver.ServerConfigError", DeprecationWarning, stacklevel=2)
        return ServerConfigError
    raise AttributeError(f"module 'envserver' has no attribute {name!r}")
