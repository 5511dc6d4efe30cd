"""What the server's other faces (OpenEnv at ``/openenv/NAME``, MCP at ``/mcp/NAME``) share.

A face speaks another protocol but runs environment methods exactly as our own sessions do:
through ``Connection``'s handlers (the session's thread pool, ``call_timeout``, argument validation,
typed errors), one request of a session at a time, counted in the same metrics. ``FaceConnection``
adds that bookkeeping (``perform``) and the plain-HTTP helpers the faces' routes need.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from envserver.connection import Connection, _describe, _RequestError
from envserver.registry import EnvSpec
from envserver.sessions import Session
from sdk.loading import did_you_mean
from sdk.protocol import ErrorCode

T = TypeVar("T")


class BodyTooLarge(Exception):
    """A request body above ``max_frame_bytes``."""


class FaceConnection(Connection):
    """A connection of another protocol (a WebSocket or one HTTP request) using ``Connection``'s
    handlers to run environment methods: ``_reset``, ``_call`` and ``_reward``, which raise
    ``_RequestError`` with our error codes."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, table: Any) -> None:
        super().__init__(scope, receive, send, table)
        self.scope = scope
        self._fuse = False  # the next sync tool call also runs get_reward, in the same pool job
        self._scored: tuple[bool, Any] | None = None  # (raised?, get_reward's result) of that job

    async def perform(self, session: Session, op: str, tool: str, run: Callable[[], Awaitable[T]]) -> T:
        """Run one request of ``session`` after the one in flight (if any), counted in the metrics;
        the reaper sees it running (never idle) and its end as the session's last activity."""
        loop = asyncio.get_running_loop()
        while session.inflight is not None:
            await asyncio.shield(session.inflight)
        session.inflight = done = loop.create_future()
        started, outcome = time.perf_counter(), "ok"
        try:
            return await run()
        except _RequestError as exc:
            outcome = exc.code.value
            raise
        except Exception:
            outcome = ErrorCode.ENVIRONMENT_ERROR.value
            raise
        finally:
            session.last_active = loop.time()
            session.inflight = None
            done.set_result(None)
            label = tool if not tool or tool in session.spec.tools else "<unknown>"  # bounded label cardinality
            self.table.metrics.request(session.spec.name, op, label, outcome, time.perf_counter() - started)

    async def call_and_reward(self, session: Session, name: str, arguments: object) -> tuple[str, float | None]:
        """A tool call and ``get_reward()`` after it (``None`` without one), as one request.

        When both are sync and the session's pool runs them, the reward runs in the tool's pool job:
        one thread hand-off instead of two (about 40 % of a call's server CPU on a trivial
        environment, ``bench/envserver/openenv_face.py``). ``_reward`` still checks its value.
        """
        spec = session.spec
        self._fuse = (spec.has_reward and not spec.reward_is_async and session.pool is not None
                      and session.pool.policy is None)

        async def both() -> tuple[str, float | None]:
            try:
                text = await self._call(session, {"tool": name, "args": arguments})
            finally:
                self._fuse = False
            try:
                return text, (await self._reward(session, {}) if spec.has_reward else None)
            finally:
                self._scored = None

        return await self.perform(session, "call", name, both)

    async def _invoke(self, session: Session, func: Callable[..., Any], is_async: bool,
                      kwargs: dict[str, Any], failure: ErrorCode, what: str) -> Any:
        scored = self._scored
        if scored is not None and func == getattr(session.env, "get_reward", None):
            self._scored = None
            raised, value = scored
            if raised:
                raise _RequestError(failure, _describe(value))
            return value
        if not self._fuse or is_async:
            return await super()._invoke(session, func, is_async, kwargs, failure, what)
        self._fuse = False
        get_reward = session.env.get_reward  # type: ignore[attr-defined]
        box: list[tuple[bool, Any]] = []

        def call_then_score(**arguments: Any) -> Any:
            value = func(**arguments)
            try:
                box.append((False, get_reward()))
            except Exception as exc:  # reported by _reward as the environment's error, not the tool's
                box.append((True, exc))
            return value

        value = await super()._invoke(session, call_then_score, False, kwargs, failure, what)
        self._scored = box[0] if box else None
        return value

    async def call_tool(self, session: Session, name: str, arguments: object) -> str:
        """``_call`` under ``perform``: the tool's text, or ``_RequestError``."""
        return await self.perform(session, "call", name,
                                  lambda: self._call(session, {"tool": name, "args": arguments}))

    async def reset(self, session: Session, kwargs: dict[str, Any]) -> str | None:
        """``_reset`` under ``perform``: the prompt, or ``_RequestError``."""
        return await self.perform(session, "reset", "", lambda: self._reset(session, {"kwargs": kwargs}))

    # -- plain HTTP ------------------------------------------------------------------------

    async def read_body(self) -> bytes:
        """The request's body, at most ``max_frame_bytes`` (``BodyTooLarge`` past it)."""
        limit, chunks, size = self.table.config.max_frame_bytes, [], 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ConnectionResetError("the client went away before sending its body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body larger than {limit} bytes (max_frame_bytes)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def respond(self, status: int, body: object, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Answer the HTTP request with ``body`` as JSON (``None``: no body)."""
        payload = b"" if body is None else json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        head = [(b"content-length", str(len(payload)).encode()), *(headers or [])]
        if body is not None:
            head.append((b"content-type", b"application/json"))
        await self._asgi_send({"type": "http.response.start", "status": status, "headers": head})
        await self._asgi_send({"type": "http.response.body", "body": payload})

    async def refuse_handshake(self, status: int, message: str) -> None:
        """Answer a WebSocket handshake with an HTTP error instead of accepting it."""
        payload = json.dumps({"error": {"code": "unknown_environment" if status == 404 else "refused",
                                        "message": message}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await self._asgi_send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await self._asgi_send({"type": "websocket.http.response.body", "body": payload})


class HttpSessionPeer:
    """What a session made over plain HTTP (an MCP session, an OpenEnv HTTP MCP session) is attached to.

    Attached, the session is reaped after ``idle_timeout`` without a request rather than after the
    resume grace. There is no connection to tell when the server ends it: the client's next request
    finds no session of that id.
    """

    async def bye(self, code: ErrorCode, message: str) -> None:
        """Nothing to close: a later request learns that the session is gone."""


HTTP_PEER = HttpSessionPeer()
"""The one peer every plain-HTTP session is attached to."""


def find_session(table: Any, spec: EnvSpec, session_id: object) -> Session | None:
    """The live session of ``spec`` with this id, if any."""
    session = table.get(session_id) if isinstance(session_id, str) else None
    return session if session is not None and session.spec is spec else None


def unknown_environment(name: str, specs: dict[str, EnvSpec]) -> str:
    """The message for a face's route naming no hosted environment."""
    return f"no environment named {name!r}{did_you_mean(name, specs)} (hosted: {', '.join(specs)})"


def split_route(path: str, prefix: str) -> tuple[str, str]:
    """``("NAME", "/rest")`` of ``prefix + "NAME/rest"``; the rest is ``""`` for ``prefix + "NAME"``."""
    name, slash, rest = path[len(prefix):].partition("/")
    return name, slash + rest
