"""toolgym's SDK: write an environment, discover its tools, and use one hosted on an env server.

* ``Environment``: the contract (subclassing is optional); ``check_env`` verifies it.
* ``Tool``, ``tool_from_function``, ``environment_tools``: (name, JSON schema, callable) for
  functions and for environments, local or remote alike.
* ``RemoteEnvironment`` (async), ``SyncRemoteEnvironment`` (scripts), ``remote_factory`` (a
  picklable ``environment_factory``): the client of the env server.
* ``ToolEnv`` / ``GymnasiumEnvironment`` / ``register_environment``: the Gymnasium bridge both ways.
* Every error derives from ``SDKError`` under the project-wide ``ToolgymError``; the tree is in
  ``sdk.exceptions``.
"""

from __future__ import annotations

from sdk.checker import check_env
from sdk.environment import RESERVED_NAMES, Environment
from sdk.exceptions import (
    AuthenticationError,
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
from sdk.loading import load_target, register_name, registered_names
from sdk.protocol import PROTOCOL_VERSION
from sdk.remote import RemoteEnvironment
from sdk.sync import SyncRemoteEnvironment
from sdk.tools import Tool, environment_tools, tool_from_function

__all__ = [
    "AuthenticationError",
    "Environment",
    "EnvironmentCheckError",
    "GymnasiumEnvironment",
    "InvalidArgumentsError",
    "MissingDocstringError",
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
    "register_environment",
    "register_name",
    "registered_names",
    "remote_factory",
    "tool_from_function",
]
