"""The tools of an MCP server as a toolgym environment (the ``mcp`` package, the protocol's reference SDK).

``MCPEnvironment(server)`` connects to a streamable-HTTP URL, or starts a stdio server command, and
offers its tools (``tools/list``: names, descriptions, input schemas) to the model. Bind it with
``functools.partial`` for ``environment_factory``; nothing connects until the first ``reset``.

* **One server per instance, or one shared** (``shared=True``: every instance of the same server in
  the process shares one connection, and one process for a command). A server process is stopped
  (its whole process group) when its last environment closes.
* **Rights.** A stdio server runs with the trainer's user and rights. It gets only the environment
  variables named in ``env`` (plus the MCP SDK's harmless defaults: ``HOME``, ``LOGNAME``, ``PATH``,
  ``SHELL``, ``TERM``, ``USER``), never the rest of the trainer's (tokens, keys), and runs in ``cwd``.
* **Failures are the model's tool failures** (``ToolCallError``, counted by the trainer): a result
  with ``isError``, an MCP error answering the call, no answer within ``call_timeout``
  (``ToolTimeoutError``), or a server that exits during the call. After the last two the server is
  restarted (or reconnected) for the next call; its state is gone. A server that cannot be started
  or reached raises ``ServerUnavailableError`` after ``connect_timeout``.
* **No reward.** An MCP server has no episodes or rewards: ``reset`` returns ``prompt`` (``None``
  by default: the dataset's prompt) and the reward comes from reward functions, which may read the
  environment (``docs/interop.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import shlex
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

from sdk.exceptions import ServerUnavailableError, ToolCallError, ToolTimeoutError, UnknownToolError
from sdk.tools import Tool

__all__ = ["MCPEnvironment"]

_SHARED: dict[tuple[asyncio.AbstractEventLoop, str], _Connection] = {}
_USERS: dict[_Connection, int] = {}


class _Connection:
    """One MCP client session (and, for a command, its server process), held open by a task of its own.

    ``mcp.Client`` must be entered and exited in one task (anyio's cancel scopes); calls may come
    from any task of the loop.
    """

    def __init__(self, target: Any, label: str) -> None:
        self.target = target
        self.label = label
        self.client: Any = None
        self.tools: list[Any] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        """Whether the session is open (its task still holds it)."""
        return self._task is not None and not self._task.done()

    async def open(self, timeout: float) -> None:
        """Connect (start the server), initialize and list the tools, within ``timeout`` seconds."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.get_running_loop().create_task(self._hold(ready), name=f"mcp {self.label}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout)
        except TimeoutError:
            await self.close()
            raise ServerUnavailableError(f"MCP server {self.label} did not answer within {timeout:g} s") from None
        except Exception as exc:
            await self.close()
            cause = _root(exc)
            raise ServerUnavailableError(f"could not start or reach MCP server {self.label}: "
                                         f"{type(cause).__name__}: {cause}") from exc

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        from mcp import Client

        try:
            async with Client(self.target, mode="legacy") as client:
                self.tools = list((await client.list_tools()).tools)
                self.client = client
                ready.set_result(None)
                await self._stop.wait()
        except Exception as exc:  # the server exited or the connection broke: calls see a dead session
            if not ready.done():
                ready.set_exception(exc)

    async def close(self) -> None:
        """Close the session; a command's server process group is stopped (SIGTERM, then SIGKILL)."""
        self._stop.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10.0)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task


class MCPEnvironment:
    """An MCP server's tools as a toolgym environment (async).

    Args:
        server: A streamable-HTTP URL (``http://host:port/mcp``), or a stdio server's command line
            (a list of arguments, or one string split like a shell does).
        env: The environment variables a stdio server gets (besides the MCP SDK's defaults).
        cwd: The stdio server's working folder.
        shared: One connection (one server process) for every instance of this server in the process.
        headers: HTTP headers for a URL (``{"Authorization": "Bearer ..."}``).
        call_timeout: Seconds a tool call may take; past it, ``ToolTimeoutError`` and a restart.
        connect_timeout: Seconds to start or reach the server and list its tools.
        prompt: What ``reset`` returns (the episode's prompt); ``None`` leaves the dataset's.
    """

    def __init__(self, server: str | Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
                 shared: bool = False, headers: Mapping[str, str] | None = None, call_timeout: float = 60.0,
                 connect_timeout: float = 30.0, prompt: str | None = None) -> None:
        self.server = server
        self.env = dict(env or {})
        self.cwd = cwd
        self.shared = shared
        self.headers = dict(headers or {})
        self.call_timeout = call_timeout
        self.connect_timeout = connect_timeout
        self.prompt = prompt
        self._connection: _Connection | None = None
        self._schemas: list[dict[str, Any]] | None = None

    @property
    def label(self) -> str:
        """The server, as error messages name it."""
        return self.server if isinstance(self.server, str) else shlex.join(self.server)

    def __repr__(self) -> str:
        return f"MCPEnvironment({self.label!r})"

    async def reset(self, **kwargs: Any) -> str | None:
        """Connect (start the server) if not yet connected; returns ``prompt``.

        Args:
            **kwargs: The dataset row's columns (unused: an MCP server has no episodes).
        """
        await self._ensure()
        return self.prompt

    async def call(self, tool: str, arguments: dict[str, Any] | None = None) -> str:
        """Call a tool and return its text content (its structured content as JSON when it has no text).

        Raises:
            ToolCallError: the call failed in any way the model should hear about (see the module).
        """
        connection = await self._ensure()
        if tool not in {t.name for t in connection.tools}:
            raise UnknownToolError("unknown_tool", f"unknown tool {tool!r}; available: "
                                   f"{', '.join(t.name for t in connection.tools) or 'none'}")
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        try:
            result = await asyncio.wait_for(connection.client.call_tool(tool, arguments or {}), self.call_timeout)
        except TimeoutError:
            await self._drop(connection)
            raise ToolTimeoutError("call_timeout", f"{tool}: no answer from MCP server {self.label} within "
                                   f"{self.call_timeout:g} s; it is restarted for the next call") from None
        except MCPError as exc:
            closed = exc.error.code == CONNECTION_CLOSED and exc.error.message == "Connection closed"
            if closed or not connection.alive:
                await self._drop(connection)
                raise ToolCallError("tool_error", f"{tool}: MCP server {self.label} exited during the call; "
                                    "it is restarted for the next call") from exc
            raise ToolCallError("tool_error", f"{tool}: {exc.error.message}") from exc
        except Exception as exc:  # the transport broke: the server died or the connection dropped
            await self._drop(connection)
            cause = _root(exc)
            raise ToolCallError("tool_error", f"{tool}: MCP server {self.label} failed during the call "
                                f"({type(cause).__name__}: {cause}); it is restarted for the next call") from exc
        text = _result_text(result)
        if result.is_error:
            raise ToolCallError("tool_error", f"{tool}: {text}")
        return text

    async def aclose(self) -> None:
        """Let go of the server: its process is stopped when no other environment shares it."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await _release(connection)

    async def __aenter__(self) -> MCPEnvironment:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The server's tools as function schemas; known once connected (after the first ``reset``)."""
        if self._schemas is None:
            raise ServerUnavailableError(f"MCPEnvironment({self.label!r}) lists its tools after connecting: "
                                         "await reset() first")
        return self._schemas

    def __toolgym_tools__(self) -> list[Tool]:
        """The server's tools as async callables (see ``sdk.environment_tools``)."""
        return [Tool(s["function"]["name"], s, functools.partial(self._call_tool, s["function"]["name"]), True)
                for s in self.tool_schemas]

    async def _call_tool(self, name: str, **arguments: Any) -> str:
        return await self.call(name, arguments)

    async def _ensure(self) -> _Connection:
        connection = self._connection
        if connection is not None and connection.alive:
            return connection
        if connection is not None:
            await self._drop(connection)
        connection = await _acquire(self) if self.shared else await _open(self)
        self._connection = connection
        self._schemas = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                           "parameters": t.input_schema}} for t in connection.tools]
        return connection

    async def _drop(self, connection: _Connection) -> None:
        """Forget a broken or stuck connection (stopping its server when no one else holds it)."""
        if self._connection is connection:
            self._connection = None
        if self.shared:
            key = (asyncio.get_running_loop(), self._key())
            if _SHARED.get(key) is connection:
                del _SHARED[key]
        await _release(connection)

    def _key(self) -> str:
        return json.dumps([self.server, self.env, self.cwd, self.headers], sort_keys=True)

    def _target(self) -> Any:
        if isinstance(self.server, str) and self.server.startswith(("http://", "https://")):
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            if not self.headers:
                return self.server
            return streamable_http_client(self.server, http_client=create_mcp_http_client(headers=self.headers))
        from mcp import StdioServerParameters

        argv = shlex.split(self.server) if isinstance(self.server, str) else list(self.server)
        if not argv:
            raise ValueError("MCPEnvironment needs a URL or a command line; got an empty command")
        command = shutil.which(argv[0]) or argv[0]  # found on the trainer's PATH
        return StdioServerParameters(command=command, args=argv[1:], env=self.env, cwd=self.cwd)


async def _open(env: MCPEnvironment) -> _Connection:
    connection = _Connection(env._target(), env.label)
    await connection.open(env.connect_timeout)
    _USERS[connection] = 1
    return connection


async def _acquire(env: MCPEnvironment) -> _Connection:
    """The shared connection of ``env``'s server on this loop (opened by the first to ask)."""
    key = (asyncio.get_running_loop(), env._key())
    connection = _SHARED.get(key)
    if connection is None or not connection.alive:
        connection = _Connection(env._target(), env.label)
        _SHARED[key] = connection
        _USERS[connection] = 0
        try:
            await connection.open(env.connect_timeout)
        except BaseException:
            _SHARED.pop(key, None)
            _USERS.pop(connection, None)
            raise
    _USERS[connection] = _USERS.get(connection, 0) + 1
    return connection


async def _release(connection: _Connection) -> None:
    users = _USERS.get(connection, 1) - 1
    if users > 0:
        _USERS[connection] = users
        return
    _USERS.pop(connection, None)
    await connection.close()


def _root(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio's task groups wrap what went wrong)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _result_text(result: Any) -> str:
    """A ``CallToolResult``'s text blocks, joined; else its structured content as JSON."""
    texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
    if texts:
        return "\n".join(texts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return json.dumps([block.model_dump(mode="json") for block in result.content], ensure_ascii=False)
