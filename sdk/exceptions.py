"""Every error the SDK raises, under one base class.

``ToolgymError`` is the root of every error of the whole project; each package has its own root
under it (``SDKError`` here, ``envserver.exceptions.EnvServerError``, ``trainer.exceptions.TrainerError``),
so ``except ToolgymError`` catches anything toolgym raises on purpose. The SDK's tree::

    ToolgymError
    └── SDKError
        ├── ToolDefinitionError            a tool cannot be described (raised at definition time)
        │   ├── MissingDocstringError          public method or function without a docstring
        │   ├── UndocumentedArgumentError      an argument missing from the ``Args:`` section
        │   └── UnsupportedTypeError           a missing or non-JSON type hint
        ├── EnvironmentCheckError          ``check_env`` found a broken environment contract
        ├── SpecNotFoundError              a ``module:Class`` spec names nothing importable
        ├── EnvironmentArgumentsError      constructor arguments an environment does not take (or bad JSON)
        ├── ProtocolError                  a peer sent a frame that breaks docs/protocol.md
        ├── ServerUnavailableError         no server answered within the connect deadline
        └── RemoteError                    the server answered with a typed error (``code``, ``message``)
            ├── ToolCallError                  the model's call failed: show ``str(error)`` to the model
            │   ├── UnknownToolError               no tool of that name
            │   ├── InvalidArgumentsError          arguments do not match the tool's JSON schema
            │   └── ToolTimeoutError               the tool ran past the server's per-call deadline
            ├── AuthenticationError            missing or wrong bearer token
            ├── UnknownEnvironmentError        the server hosts no environment of that name
            ├── ServerFullError                session limit reached and the wait queue full or timed out
            ├── ServerDrainingError            the server is shutting down and takes no new episode
            └── SessionLostError               the session is gone (closed, evicted, expired, not found)

``ToolCallError`` is the one family a training loop should turn into a tool message: it is the
remote twin of a local tool raising. Every other ``RemoteError`` is an infrastructure failure.
"""

from __future__ import annotations


class ToolgymError(Exception):
    """The root of every error toolgym raises on purpose (``sdk``, ``envserver``, ``trainer``, ``toolgym``)."""


class SDKError(ToolgymError):
    """Base class of the SDK's errors (tools, environment checks, the env server client)."""


class ToolDefinitionError(SDKError, TypeError):
    """A function or environment method cannot be turned into a tool."""


class MissingDocstringError(ToolDefinitionError):
    """A tool has no docstring, so the model would get no description of it."""


class UndocumentedArgumentError(ToolDefinitionError):
    """A tool argument is not described in the docstring's ``Args:`` section."""


class UnsupportedTypeError(ToolDefinitionError):
    """A tool argument has no type hint, or one that JSON schema cannot express."""


class EnvironmentCheckError(SDKError):
    """An environment breaks the contract that ``sdk.check_env`` verifies."""


class EnvironmentArgumentsError(SDKError, ValueError):
    """Constructor arguments (``--env_kwargs``) that are not JSON, or that the environment does not take."""


class SpecNotFoundError(SDKError, LookupError):
    """A ``module:Class`` (or bundled short name) spec names no importable module or attribute."""


class ProtocolError(SDKError):
    """A frame that does not follow the wire protocol, or an unsupported protocol version."""


class ServerUnavailableError(SDKError, ConnectionError):
    """No env server could be reached before the connect deadline."""


class RemoteError(SDKError):
    """A typed error reported by the env server.

    Attributes:
        code: The protocol error code (see ``sdk.protocol.ErrorCode``).
        message: The server's human-readable explanation.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ToolCallError(RemoteError):
    """A tool call failed in a way the model caused or should hear about.

    ``str(error)`` is the text to put in the tool message, e.g. ``"ValueError: step must be > 0"``.
    """


class UnknownToolError(ToolCallError):
    """The environment has no tool of the requested name."""


class InvalidArgumentsError(ToolCallError):
    """The arguments do not match the tool's JSON schema (missing, unexpected or mistyped)."""


class ToolTimeoutError(ToolCallError):
    """The tool did not finish within the server's per-call deadline."""


class AuthenticationError(RemoteError):
    """The server requires a bearer token and the one given is missing or wrong."""


class UnknownEnvironmentError(RemoteError):
    """The server hosts no environment of the requested name."""


class ServerFullError(RemoteError):
    """The server is at its session limit and its wait queue is full or the wait timed out."""


class ServerDrainingError(RemoteError):
    """The server is draining before shutdown and refuses new sessions and new episodes."""


class SessionLostError(RemoteError):
    """The session no longer exists: closed, reaped while idle, expired, or evicted by a drain."""
