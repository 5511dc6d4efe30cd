"""The env server: hosts environment classes over WebSocket sessions (``toolgym serve``).

Build one in code with ``EnvServer(parse_specs(["counter"]), ServerConfig(port=8765)).run()``, or
on a background thread with ``ServerThread``; the wire protocol is in ``docs/protocol.md``.
"""

from __future__ import annotations

from envserver.app import create_app
from envserver.config import ServerConfig
from envserver.exceptions import ConfigError, EnvServerError, EnvSpecError
from envserver.registry import EnvSpec, parse_specs
from envserver.server import EnvServer, ServerThread

__all__ = [
    "ConfigError",
    "EnvServer",
    "EnvServerError",
    "EnvSpec",
    "EnvSpecError",
    "ServerConfig",
    "ServerThread",
    "create_app",
    "parse_specs",
]
