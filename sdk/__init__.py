"""toolgym's SDK: write an environment, discover its tools, and use one hosted on an env server.

* ``Environment``: the contract (subclassing is optional); ``check_env`` verifies it.
* ``Tool``, ``tool_from_function``, ``environment_tools``: (name, JSON schema, callable) for
  functions and for environments, local or remote alike.
* ``RemoteEnvironment`` (async), ``SyncRemoteEnvironment`` (scripts), ``remote_factory`` (a
  picklable ``environment_factory``): the client of the env server.
* ``OpenEnvEnvironment``, ``MCPEnvironment``: an OpenEnv server's environment, an MCP server's
  tools, as a toolgym environment (``docs/interop.md``).
* ``ToolEnv`` / ``GymnasiumEnvironment`` / ``register_environment``: the Gymnasium bridge both ways.
* Every error derives from ``SDKError`` under the project-wide ``ToolgymError``; the tree is in
  ``sdk.exceptions``.

Names are imported on first use, so ``import sdk.exceptions`` (which every package's errors derive
from) loads neither the WebSocket client nor Gymnasium: the trainer's training side runs on images
that have neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sdk.checker import check_env
    from sdk.environment import RESERVED_NAMES, Environment
    from sdk.exceptions import (
        AuthenticationError,
        EnvironmentArgumentsError,
        EnvironmentCheckError,
        InvalidArgumentsError,
        MissingDocstringError,
        ProtocolError,
        RemoteError,
        SDKError,
        ServerDrainingError,
        ServerFullError,
        ServerUnavailableError,
        SessionLostError,
        SpecNotFoundError,
        ToolCallError,
        ToolDefinitionError,
        ToolgymError,
        ToolTimeoutError,
        UndocumentedArgumentError,
        UnknownEnvironmentError,
        UnknownToolError,
        UnsupportedTypeError,
    )
    from sdk.factory import RemoteFactory, remote_factory
    from sdk.gym import GymnasiumEnvironment, ToolEnv, register_environment
    from sdk.loading import load_target, parse_env_kwargs, register_name, registered_names, with_arguments
    from sdk.protocol import PROTOCOL_VERSION
    from sdk.remote import RemoteEnvironment
    from sdk.sync import SyncRemoteEnvironment
    from sdk.tools import Tool, environment_tools, tool_from_function

__all__ = [
    "AuthenticationError",
    "Environment",
    "EnvironmentArgumentsError",
    "EnvironmentCheckError",
    "GymnasiumEnvironment",
    "InvalidArgumentsError",
    "MCPEnvironment",
    "MissingDocstringError",
    "OpenEnvEnvironment",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "RESERVED_NAMES",
    "RemoteEnvironment",
    "RemoteError",
    "RemoteFactory",
    "SDKError",
    "ServerDrainingError",
    "ServerFullError",
    "ServerUnavailableError",
    "SessionLostError",
    "SpecNotFoundError",
    "SyncRemoteEnvironment",
    "Tool",
    "ToolCallError",
    "ToolDefinitionError",
    "ToolEnv",
    "ToolTimeoutError",
    "ToolgymError",
    "UndocumentedArgumentError",
    "UnknownEnvironmentError",
    "UnknownToolError",
    "UnsupportedTypeError",
    "check_env",
    "environment_tools",
    "load_target",
    "parse_env_kwargs",
    "register_environment",
    "register_name",
    "registered_names",
    "remote_factory",
    "tool_from_function",
    "with_arguments",
]

_LAZY = {
    "AuthenticationError": "sdk.exceptions",
    "Environment": "sdk.environment",
    "EnvironmentCheckError": "sdk.exceptions",
    "GymnasiumEnvironment": "sdk.gym",
    "InvalidArgumentsError": "sdk.exceptions",
    "MCPEnvironment": "sdk.mcp",
    "MissingDocstringError": "sdk.exceptions",
    "OpenEnvEnvironment": "sdk.openenv",
    "PROTOCOL_VERSION": "sdk.protocol",
    "ProtocolError": "sdk.exceptions",
    "RESERVED_NAMES": "sdk.environment",
    "RemoteEnvironment": "sdk.remote",
    "RemoteError": "sdk.exceptions",
    "RemoteFactory": "sdk.factory",
    "EnvironmentArgumentsError": "sdk.exceptions",
    "SDKError": "sdk.exceptions",
    "ServerDrainingError": "sdk.exceptions",
    "ServerFullError": "sdk.exceptions",
    "ServerUnavailableError": "sdk.exceptions",
    "SessionLostError": "sdk.exceptions",
    "SpecNotFoundError": "sdk.exceptions",
    "SyncRemoteEnvironment": "sdk.sync",
    "Tool": "sdk.tools",
    "ToolCallError": "sdk.exceptions",
    "ToolDefinitionError": "sdk.exceptions",
    "ToolEnv": "sdk.gym",
    "ToolTimeoutError": "sdk.exceptions",
    "ToolgymError": "sdk.exceptions",
    "UndocumentedArgumentError": "sdk.exceptions",
    "UnknownEnvironmentError": "sdk.exceptions",
    "UnknownToolError": "sdk.exceptions",
    "UnsupportedTypeError": "sdk.exceptions",
    "check_env": "sdk.checker",
    "environment_tools": "sdk.tools",
    "load_target": "sdk.loading",
    "parse_env_kwargs": "sdk.loading",
    "register_environment": "sdk.gym",
    "register_name": "sdk.loading",
    "registered_names": "sdk.loading",
    "with_arguments": "sdk.loading",
    "remote_factory": "sdk.factory",
    "tool_from_function": "sdk.tools",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sdk' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
