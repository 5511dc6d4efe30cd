"""An OpenEnv server's environment as a toolgym environment: one OpenEnv WebSocket session per instance.

``OpenEnvEnvironment(base_url)`` is what ``environment_factory`` makes (bind the URL with
``functools.partial``): ``reset`` / tools / ``get_reward``, async, connected lazily inside the
rollout worker's event loop, one OpenEnv session reused across episodes.

* **Tools.** An MCP-style environment's tools (``tools/list`` through an ``mcp`` frame) with their
  schemas; an action-style one gets one tool, ``step``, whose parameters are the action's JSON schema
  from ``/schema``. MCP tools are called through ``step`` frames carrying OpenEnv's call-tool action,
  so each call's observation brings the environment's reward and ``done``.
* **Reward.** The reward the last observation carried (``reward="sum"``: the episode's sum); ``None``
  when none carried one. After an observation with ``done``, further calls are tool failures that say
  the episode is over.
* **Failures.** A server that is down raises ``ServerUnavailableError`` after ``connect_timeout``; at
  capacity, ``ServerFullError``; an error frame answering a step is a tool failure
  (``InvalidArgumentsError`` for a ``VALIDATION_ERROR``, ``ToolCallError`` otherwise); a step with no
  answer within ``message_timeout`` is a ``ToolTimeoutError``. OpenEnv sessions cannot resume: a
  dropped connection (or one dropped after a timeout) raises ``SessionLostError`` for the rest of the
  episode, never a silent fresh episode; the next ``reset`` opens a new session. A frame of a type
  OpenEnv 0.10 does not send is a ``ProtocolError``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Literal, cast

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from sdk._http import normalize_url
from sdk._openenv_wire import (
    STEP_TOOL,
    action_tool_schema,
    call_result_text,
    error_frame,
    mcp_tool_schema,
    observation_text,
    tool_error,
)
from sdk.exceptions import (
    AuthenticationError,
    ProtocolError,
    ServerUnavailableError,
    SessionLostError,
    ToolCallError,
    ToolTimeoutError,
    UnknownToolError,
)
from sdk.tools import Tool

__all__ = ["OpenEnvEnvironment", "observation_text"]

_MAX_FRAME = 64 << 20
_EXPECTED = {"reset": "observation", "step": "observation", "state": "state", "mcp": "mcp"}


class OpenEnvEnvironment:
    """One session on an OpenEnv server, used like a local toolgym environment (async).

    Args:
        base_url: The environment's base URL (``http://host:port``, or a path below it such as
            toolgym's ``http://host:port/openenv/NAME``); its WebSocket is ``{base_url}/ws``.
        token: Bearer token sent as ``Authorization`` (to a toolgym server's OpenEnv face, or a
            proxy in front of OpenEnv); ``headers`` for anything else.
        headers: Extra HTTP headers of the WebSocket handshake and the ``/schema`` request.
        connect_timeout: Seconds to keep trying to reach the server before ``ServerUnavailableError``.
        message_timeout: Seconds to wait for the answer to one frame; past it a step is a
            ``ToolTimeoutError`` and the session is dropped (its answer would arrive out of order).
        reward: ``"last"``: the reward of the last observation that carried one; ``"sum"``: the
            sum over the episode.
        format_observation: The text of an observation (its ``observation`` object) for the
            prompt and for ``step`` results; module-level so the factory pickles. Default
            ``observation_text``: the one text field, else the fields as JSON.
    """

    def __init__(self, base_url: str, *, token: str | None = None, headers: dict[str, str] | None = None,
                 connect_timeout: float = 10.0, message_timeout: float = 60.0,
                 reward: Literal["last", "sum"] = "last",
                 format_observation: Callable[[dict[str, Any]], str] = observation_text) -> None:
        if reward not in ("last", "sum"):
            raise ValueError(f"reward must be 'last' or 'sum', got {reward!r}")
        self.base_url = normalize_url(base_url)
        self.headers = dict(headers or {})
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.connect_timeout = connect_timeout
        self.message_timeout = message_timeout
        self.reward_mode = reward
        self.format_observation = format_observation
        self.done = False
        self.rewards: list[float] = []
        self.last_observation: dict[str, Any] | None = None
        self._schemas: list[dict[str, Any]] | None = None
        self._mcp_style = False
        self._ws: ClientConnection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._lost: str | None = None  # why the episode's session is gone, until the next reset
        self._rpc_id = 0

    def __repr__(self) -> str:
        return f"OpenEnvEnvironment({self.base_url!r})"

    # -- the environment contract ----------------------------------------------------------

    async def reset(self, **kwargs: Any) -> str | None:
        """Start an episode (on the open session, else a new one) and return its prompt.

        Args:
            **kwargs: Sent as the ``reset`` frame's data (the dataset row's columns; OpenEnv passes
                the ones its environment's ``reset`` takes).

        Returns:
            The reset observation's text, or ``None`` when it has none.
        """
        self._lost = None
        try:
            reply = await self._request("reset", {"type": "reset", "data": kwargs})
        except SessionLostError:  # the session was gone before this episode: a new one needs no state
            self._lost = None
            reply = await self._request("reset", {"type": "reset", "data": kwargs})
        self.done, self.rewards = False, []
        return self._observe(reply) or None

    async def call(self, tool: str, arguments: dict[str, Any] | None = None) -> str:
        """Call a tool: an MCP tool through a call-tool action, or ``step`` with the action's fields.

        Raises:
            ToolCallError: the tool failed, the action did not validate, no such tool, the answer
                did not come within ``message_timeout``, or the episode is over.
            SessionLostError: the connection dropped during this episode.
        """
        await self._ensure_described()
        if self.done:
            raise ToolCallError("episode_done", f"{tool}: the episode is over (the environment said done); "
                                "no further actions are taken")
        if self._mcp_style:
            action = {"type": "call_tool", "tool_name": tool, "arguments": arguments or {}}
        elif tool == STEP_TOOL:
            action = dict(arguments or {})
        else:
            raise UnknownToolError("unknown_tool", f"unknown tool {tool!r}; available: {STEP_TOOL}")
        reply = await self._request("step", {"type": "step", "data": action})
        text = self._observe(reply)
        if not self._mcp_style:
            return text
        observation = self.last_observation or {}
        if observation.get("error"):
            raise tool_error(observation["error"], tool)
        result, is_error = call_result_text(observation.get("result"))
        if is_error:
            raise ToolCallError("tool_error", f"{tool}: {result}")
        return result

    async def get_reward(self) -> float | None:
        """The episode's reward from its observations (see ``reward``); ``None`` when none carried one."""
        if not self.rewards:
            return None
        return self.rewards[-1] if self.reward_mode == "last" else sum(self.rewards)

    async def state(self) -> dict[str, Any]:
        """The session's OpenEnv state (``episode_id``, ``step_count`` and the environment's own fields)."""
        reply = await self._request("state", {"type": "state"})
        return cast("dict[str, Any]", reply.get("data") or {})

    async def aclose(self) -> None:
        """End the session (a ``close`` frame) and close the connection (idempotent)."""
        ws, self._ws = self._ws, None
        if ws is None or self._loop is not asyncio.get_running_loop():
            return
        try:
            await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), 5.0)
        except (ConnectionClosed, OSError, TimeoutError):
            pass  # the server ends the session with the connection anyway
        await ws.close()

    async def __aenter__(self) -> OpenEnvEnvironment:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- tools -----------------------------------------------------------------------------

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' function schemas (read over HTTP, once per process, before the first ``reset``)."""
        if self._schemas is None:
            self._schemas, self._mcp_style = _describe_over_http(self.base_url, tuple(self.headers.items()),
                                                                 self.connect_timeout)
        return self._schemas

    def __toolgym_tools__(self) -> list[Tool]:
        """The tools as async callables bound to this session (see ``sdk.environment_tools``)."""
        return [Tool(schema["function"]["name"], schema,
                     functools.partial(self._call_tool, schema["function"]["name"]), True)
                for schema in self.tool_schemas]

    async def _call_tool(self, name: str, **arguments: Any) -> str:
        return await self.call(name, arguments)

    async def _ensure_described(self) -> None:
        if self._schemas is not None:
            return
        self._rpc_id += 1
        reply = await self._request("mcp", {"type": "mcp", "data": {
            "jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": self._rpc_id}})
        tools = (reply.get("data") or {}).get("result", {}) or {}
        if isinstance(tools, dict) and isinstance(tools.get("tools"), list):
            self._schemas, self._mcp_style = [mcp_tool_schema(t) for t in tools["tools"]], True
        else:  # "Environment does not support MCP": an action-style environment
            schema = await asyncio.to_thread(_get_json, self.base_url + "/schema", tuple(self.headers.items()),
                                             self.connect_timeout)
            self._schemas, self._mcp_style = [action_tool_schema(schema["action"])], False

    # -- frames ----------------------------------------------------------------------------

    def _observe(self, reply: dict[str, Any]) -> str:
        """Take an observation frame's reward and ``done``; return its text."""
        data = reply.get("data") or {}
        observation = data.get("observation") or {}
        self.last_observation = observation
        reward = data.get("reward")
        if isinstance(reward, (int, float)) and not isinstance(reward, bool):
            self.rewards.append(float(reward))
        self.done = bool(data.get("done", False))
        return self.format_observation(observation)

    async def _request(self, kind: str, message: dict[str, Any]) -> dict[str, Any]:
        """Send one frame and return its answer (OpenEnv answers in order, one frame each)."""
        if self._lost is not None:
            raise SessionLostError("session_closed", self._lost)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or moved to another loop: the socket cannot follow
            self._ws, self._loop, self._lock = None, loop, asyncio.Lock()
        assert self._lock is not None
        async with self._lock:
            if self._ws is None:
                self._ws = await self._connect()
            ws = self._ws
            try:
                try:
                    await ws.send(json.dumps(message))
                except ConnectionClosed:
                    pass  # a refused session sends an error frame, then closes: read it below
                raw = await asyncio.wait_for(ws.recv(), self.message_timeout)
            except TimeoutError:
                self._forget(f"no answer from {self.base_url} to a {kind} within {self.message_timeout:g} s; "
                             "the session was dropped (OpenEnv sessions cannot resume)")
                if kind == "step":
                    raise ToolTimeoutError("call_timeout", f"{message['data'].get('tool_name', STEP_TOOL)}: no answer "
                                           f"within {self.message_timeout:g} s") from None
                raise ServerUnavailableError(self._lost or "") from None
            except (ConnectionClosed, OSError) as exc:
                self._forget(f"the connection to {self.base_url} dropped during the episode ({exc}); OpenEnv "
                             "sessions cannot resume, so the episode's state is gone")
                raise SessionLostError("session_closed", self._lost or "") from exc
        return self._check(kind, raw)

    def _check(self, kind: str, raw: str | bytes) -> dict[str, Any]:
        try:
            frame = json.loads(raw)
        except ValueError as exc:
            self._forget("the server sent a frame that is not JSON")
            raise ProtocolError(f"OpenEnv server {self.base_url} sent a frame that is not JSON: {exc}") from exc
        frame_type = frame.get("type") if isinstance(frame, dict) else None
        if frame_type == "error":
            error = error_frame(frame.get("data") or {}, kind, self.base_url)
            if not isinstance(error, ToolCallError):
                self._forget(str(error))  # a refused or broken session: the next reset opens a new one
            raise error
        if frame_type != _EXPECTED[kind]:
            self._forget("the server sent a frame out of protocol")
            raise ProtocolError(f"OpenEnv server {self.base_url} answered a {kind!r} frame with "
                                f"{str(raw)[:200]!r}; expected a frame of type {_EXPECTED[kind]!r} (OpenEnv 0.10)")
        return cast("dict[str, Any]", frame)

    def _forget(self, why: str) -> None:
        """Drop the socket (closing it in the background) and remember why the session is gone."""
        ws, self._ws, self._lost = self._ws, None, why
        if ws is not None:
            asyncio.get_running_loop().create_task(ws.close())

    async def _connect(self) -> ClientConnection:
        url = "ws" + self.base_url[4:] + "/ws"
        deadline = time.monotonic() + self.connect_timeout
        delay, last_error = 0.05, "no attempt made"
        while True:
            try:
                return await connect(url, additional_headers=self.headers or None, compression=None, proxy=None,
                                     max_size=_MAX_FRAME, open_timeout=self.connect_timeout)
            except InvalidStatus as exc:
                if exc.response.status_code in (401, 403):
                    raise AuthenticationError("unauthorized", f"{url} refused the handshake "
                                              f"(HTTP {exc.response.status_code}): check token/headers") from exc
                last_error = f"HTTP {exc.response.status_code}"
            except (OSError, TimeoutError, InvalidHandshake) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > deadline:
                raise ServerUnavailableError(f"could not reach OpenEnv server {url} within "
                                             f"{self.connect_timeout:g} s ({last_error})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


def _get_json(url: str, headers: tuple[tuple[str, str], ...], timeout: float, body: bytes | None = None) -> Any:
    request = urllib.request.Request(url, data=body, headers=dict(headers))
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (http only)
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise AuthenticationError("unauthorized", f"{url} refused the request (HTTP {exc.code})") from exc
        raise ServerUnavailableError(f"{url} answered HTTP {exc.code}") from exc
    except (OSError, ValueError) as exc:
        raise ServerUnavailableError(f"could not read {url}: {exc}") from exc


@functools.cache
def _describe_over_http(base_url: str, headers: tuple[tuple[str, str], ...],
                        timeout: float) -> tuple[list[dict[str, Any]], bool]:
    """``(tool schemas, MCP-style?)`` from ``POST /mcp`` ``tools/list``, else ``GET /schema``; once per process."""
    body = json.dumps({"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1}).encode()
    try:
        listed = _get_json(base_url + "/mcp", headers, timeout, body)
    except ServerUnavailableError:  # no POST /mcp (a server in production mode answers it; others may not)
        listed = {}
    tools = (listed.get("result") or {}).get("tools") if isinstance(listed, dict) else None
    if isinstance(tools, list):
        return [mcp_tool_schema(t) for t in tools], True
    schema = _get_json(base_url + "/schema", headers, timeout)
    return [action_tool_schema(schema["action"])], False
