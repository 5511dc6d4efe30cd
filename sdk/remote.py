"""The remote client: an environment hosted on an env server, with the surface of a local one.

``RemoteEnvironment`` is async and connects lazily, on its first awaited call, inside whatever event
loop runs it, so it can be built anywhere (a factory in a spawned worker) and used from that
worker's loop. One instance is one session, reused across episodes: ``reset`` starts the next one.

Failure handling, in short:

* A dropped connection is reconnected and the session resumed by id; the request in flight is
  resent with the same id and the server replays its reply instead of running it twice.
* ``reset`` on a session the server no longer has (reaped while idle, expired, draining), or whose
  connection dropped, opens a fresh session instead of resuming, trying every replica given: a new
  episode needs no old state, so a dead server costs a ``reset`` one refused connection, not a wait.
* A dead server raises ``ServerUnavailableError`` after ``connect_timeout`` seconds, never hangs.
* A tool failure (it raised, bad arguments, unknown tool, deadline) raises ``ToolCallError`` whose
  ``str()`` is the text to show the model; see ``sdk.exceptions`` for the rest.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from sdk import protocol
from sdk._http import fetch_description, normalize_url, ws_url
from sdk.exceptions import (
    AuthenticationError,
    ProtocolError,
    RemoteError,
    ServerDrainingError,
    ServerUnavailableError,
    SessionLostError,
)
from sdk.tools import Tool

_RESUME_ATTEMPTS = 3
_MAX_FRAME = 64 << 20


class RemoteEnvironment:
    """One session on an env server, used like a local environment (async).

    Args:
        url: Server base URL (``http://host:port``; ``ws://`` and a bare ``host:port`` work too).
        env_name: Name of the hosted environment.
        token: Bearer token, when the server requires one.
        fallback_urls: Other replicas to open a session on when ``url`` is down or draining. A
            session never moves while it is alive; only a new session goes elsewhere.
        connect_timeout: Seconds to keep trying to reach a server before ``ServerUnavailableError``.
        open_timeout: Seconds to wait for the server's hello once connected (it may queue a new
            session while full).
        request_timeout: Seconds to wait for a reply; defaults to the server's per-call deadline
            plus 10 s. Past it the connection is treated as dead.
    """

    def __init__(self, url: str, env_name: str, *, token: str | None = None,
                 fallback_urls: Sequence[str] = (), connect_timeout: float = 10.0,
                 open_timeout: float = 60.0, request_timeout: float | None = None) -> None:
        self.url = normalize_url(url)
        self.env_name = env_name
        self.token = token
        self.fallback_urls = [normalize_url(u) for u in fallback_urls if normalize_url(u) != self.url]
        self.connect_timeout = connect_timeout
        self.open_timeout = open_timeout
        self.request_timeout = request_timeout
        self.session_id: str | None = None
        self._description: dict[str, Any] | None = None
        self._limits: dict[str, Any] = {}
        self._ws: ClientConnection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._next_id = 1
        self._closed = False

    def __repr__(self) -> str:
        return f"RemoteEnvironment({self.url!r}, {self.env_name!r}, session={self.session_id!r})"

    async def reset(self, **kwargs: Any) -> str | None:
        """Start a new episode on the session (opening one first if needed).

        Args:
            **kwargs: Passed to the environment's ``reset`` (e.g. the dataset row's columns).

        Returns:
            The prompt string, or ``None``.

        Raises:
            RemoteError: ``environment_error`` when the environment's ``reset`` raised, and the
                other typed errors of ``sdk.exceptions``.
        """
        try:
            return cast("str | None", await self._request(protocol.Op.RESET, resume=False, kwargs=kwargs))
        except (SessionLostError, ServerDrainingError):
            # A new episode needs no old state: start over on a fresh session, elsewhere if possible.
            await self._drop(rotate=True)
            return cast("str | None", await self._request(protocol.Op.RESET, kwargs=kwargs))

    async def get_reward(self) -> float | None:
        """The environment's reward for the episode so far; ``None`` if it defines no ``get_reward``."""
        return cast("float | None", await self._request(protocol.Op.REWARD))

    async def call(self, tool: str, arguments: dict[str, Any] | None = None) -> str:
        """Call a tool and return its result as text.

        Args:
            tool: The tool's name.
            arguments: Its arguments (checked by the server against the tool's JSON schema).

        Returns:
            ``str()`` of what the tool returned.

        Raises:
            ToolCallError: the tool raised, the arguments do not match its schema, no such tool, or
                it ran past the server's deadline. ``str(error)`` is the text to show the model.
            SessionLostError: the session ended (the episode's state is gone).
        """
        return cast(str, await self._request(protocol.Op.CALL, tool=tool, args=arguments or {}))

    async def aclose(self) -> None:
        """End the session on the server and close the connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._ws is not None and self._loop is asyncio.get_running_loop():
            try:
                await asyncio.wait_for(self._send_close(), timeout=5.0)
            except (ConnectionClosed, OSError, RemoteError, TimeoutError):
                pass  # the server ends it anyway: it expires after the resume grace period
        await self._drop(rotate=False)

    async def __aenter__(self) -> RemoteEnvironment:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The hosted environment's tool schemas (fetched over HTTP, once per process, if not connected)."""
        return cast("list[dict[str, Any]]", self._describe()["tools"])

    def __toolgym_tools__(self) -> list[Tool]:
        """The server's tools as async callables bound to this session (see ``sdk.environment_tools``)."""
        return [
            Tool(schema["function"]["name"], schema,
                 functools.partial(self._call_tool, schema["function"]["name"]), True)
            for schema in self.tool_schemas
        ]

    async def _call_tool(self, name: str, **arguments: Any) -> str:
        return await self.call(name, arguments)

    def __getattr__(self, name: str) -> Callable[..., Awaitable[str]]:
        """A hosted tool as a coroutine method, as on a local environment: ``await env.guess(code=5)``."""
        if name.startswith("_") or name not in {s["function"]["name"] for s in self.tool_schemas}:
            raise AttributeError(f"{type(self).__name__} has no attribute or remote tool {name!r}")
        return functools.partial(self._call_tool, name)

    def _describe(self) -> dict[str, Any]:
        if self._description is None:
            self._description = fetch_description(self.url, self.env_name, self.token, self.connect_timeout)
        return self._description

    # -- connection management -------------------------------------------------------------

    async def _request(self, op: str, resume: bool = True, **fields: Any) -> Any:
        """Send one request and return its result; a dropped connection resumes the session (or,
        with ``resume=False``, opens a new one on any replica) and resends."""
        if self._closed:
            raise SessionLostError(protocol.ErrorCode.SESSION_CLOSED, "this RemoteEnvironment was closed")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or moved to another loop: the socket cannot follow
            self._ws, self._loop, self._lock = None, loop, asyncio.Lock()
        assert self._lock is not None
        async with self._lock:
            rid = self._next_id
            self._next_id += 1
            frame = protocol.dumps({"id": rid, "op": op, **fields})
            for attempt in range(_RESUME_ATTEMPTS + 1):
                if self._ws is None and not resume:
                    self.session_id = None  # the old session (if any) expires on the server
                ws = self._ws or await self._connect()
                try:
                    await ws.send(frame)
                    reply = await self._reply(ws, rid)
                    break
                except (ConnectionClosed, OSError, TimeoutError) as exc:
                    self._ws = None
                    if attempt == _RESUME_ATTEMPTS:
                        raise ServerUnavailableError(f"lost the connection to {self.url} {attempt + 1} times "
                                                     f"during one request: {exc}") from exc
        if reply.get("ok"):
            return reply.get("result")
        raise protocol.remote_error(reply.get("error") or {})

    async def _reply(self, ws: ClientConnection, rid: int) -> dict[str, Any]:
        timeout = self.request_timeout or float(self._limits.get("call_timeout", 60.0)) + 10.0
        while True:
            frame = self._decode(await asyncio.wait_for(ws.recv(), timeout))
            if frame.get("op") == protocol.Op.BYE:
                self._ws, self.session_id = None, None
                await ws.close()
                raise protocol.remote_error(frame.get("error") or {})
            if frame.get("id") == rid:
                return frame

    async def _connect(self) -> ClientConnection:
        """Resume the current session, or open a new one; tries until ``connect_timeout``."""
        urls = [self.url] if self.session_id else [self.url, *self.fallback_urls]
        deadline = time.monotonic() + self.connect_timeout
        delay, last_error = 0.05, "no attempt made"
        while True:
            for url in urls:
                try:
                    return await self._open(url)
                except ServerDrainingError as exc:
                    last_error = str(exc)  # try the next replica
                except (ConnectionClosed, OSError, TimeoutError, InvalidHandshake) as exc:
                    # ConnectionClosed: the server accepted the handshake, then died before its hello.
                    last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > deadline:
                raise ServerUnavailableError(
                    f"could not reach env server {' or '.join(urls)} within {self.connect_timeout:g} s "
                    f"({last_error})"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _open(self, url: str) -> ClientConnection:
        query = f"?v={protocol.PROTOCOL_VERSION}" + (f"&session={self.session_id}" if self.session_id else "")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        try:
            ws = await connect(ws_url(url, self.env_name) + query, additional_headers=headers,
                               compression=None, proxy=None, max_size=_MAX_FRAME, max_queue=None,
                               open_timeout=min(self.connect_timeout, self.open_timeout))
        except InvalidStatus as exc:
            if exc.response.status_code == 401:
                raise AuthenticationError(protocol.ErrorCode.UNAUTHORIZED,
                                          f"{url} refused the bearer token (HTTP 401)") from exc
            raise
        hello = self._decode(await asyncio.wait_for(ws.recv(), self.open_timeout))
        if hello.get("op") != protocol.Op.HELLO:
            await ws.close()
            error = protocol.remote_error(hello.get("error") or {})
            if self.session_id and isinstance(error, SessionLostError):
                self.session_id = None
            raise error
        self.url, self.session_id, self._ws = url, hello["session"], ws
        self._limits = hello.get("limits", {})
        self._description = {"tools": hello.get("tools", []), "has_reward": hello.get("has_reward", False)}
        return ws

    async def _send_close(self) -> None:
        assert self._ws is not None and self._lock is not None
        async with self._lock:
            rid = self._next_id
            self._next_id += 1
            await self._ws.send(protocol.dumps({"id": rid, "op": protocol.Op.CLOSE}))
            await self._reply(self._ws, rid)

    async def _drop(self, rotate: bool) -> None:
        """Forget the session (closing the socket if it belongs to this loop); maybe move replicas."""
        ws, self._ws, self.session_id = self._ws, None, None
        if ws is not None and self._loop is asyncio.get_running_loop():
            await ws.close()
        if rotate and self.fallback_urls:
            self.fallback_urls.append(self.url)
            self.url = self.fallback_urls.pop(0)

    @staticmethod
    def _decode(text: str | bytes) -> dict[str, Any]:
        try:
            frame = protocol.loads(text)
        except ValueError as exc:
            raise ProtocolError(f"server sent a frame that is not JSON: {exc}") from exc
        if not isinstance(frame, dict):
            raise ProtocolError(f"server sent a frame that is not an object: {frame!r}")
        return frame
