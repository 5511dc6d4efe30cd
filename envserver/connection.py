"""One WebSocket connection: open or resume a session, then answer its requests in order.

Every failure becomes a typed error frame (``sdk.protocol.ErrorCode``); only a frame above the hard
size limit or a dead socket ends the connection without one. That includes input the JSON layer
chokes on (nesting deeper than the parser's recursion limit) and replies that cannot be encoded: a
tool result whose ``str()`` raises, text with a lone surrogate (error messages carry it escaped,
results are refused), a non-finite reward. Requests of a session run one at a time, so an
environment instance is never used by two threads at once.

Every request id gets exactly one reply of its own: a request resent after a resume (same id) is
never run twice and gets the original reply, or a typed error when that reply is gone (a later
request already ran), never the reply to another id.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from envserver.sessions import Refused, Session, SessionBusy, SessionTable
from sdk import protocol
from sdk.loading import did_you_mean
from sdk.protocol import CLOSE_SESSION_ENDED, ErrorCode, Op, error_reply, ok_reply

logger = logging.getLogger("envserver.connection")


class _RequestError(Exception):
    """Ends one request with a typed error reply; the session goes on."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Connection:
    """Serves one WebSocket, spoken to as raw ASGI: the session attached to it and its frames.

    Raw ASGI rather than Starlette's ``WebSocket`` wrapper: its state checks and the router in
    front of it cost a measurable share of a short session's CPU time (``bench/envserver``).
    """

    def __init__(self, scope: Scope, receive: Receive, send: Send, table: SessionTable) -> None:
        self.query = _parse_query(scope["query_string"].decode("latin-1"))
        self._receive = receive
        self._asgi_send = send
        self.table = table
        self._closed = False

    async def serve(self, env_name: str) -> None:
        """Accept, attach a session (new or resumed), then serve frames until the socket ends."""
        if (await self._receive())["type"] != "websocket.connect":  # the peer left before the handshake
            return
        await self._asgi_send({"type": "websocket.accept"})
        resumed = "session" in self.query
        session = await self._attach(env_name)
        if session is None:
            return
        try:
            await self._send(self._hello(session, resumed))
            # A task of its own: each wake-up of the frame loop (two per request) then resumes only
            # its coroutines, not also the ASGI middleware chain above serve() (~6 frames deep).
            await asyncio.get_running_loop().create_task(self._serve_frames(session))
        finally:
            if session.alive:
                self.table.detach(session, self)

    async def bye(self, code: ErrorCode, message: str) -> None:
        """Send a ``bye`` frame with the reason, then close the socket (at most once)."""
        if self._closed:
            return
        self._closed = True
        await self._send(protocol.dumps({"op": Op.BYE, "error": protocol.error_payload(code, _wire_text(message))}))
        await self._close_socket()

    async def _close_socket(self) -> None:
        self._closed = True
        try:
            await self._asgi_send({"type": "websocket.close", "code": CLOSE_SESSION_ENDED})
        except (RuntimeError, OSError):  # already closed by the peer
            pass

    async def _attach(self, env_name: str) -> Session | None:
        query = self.query
        table = self.table
        if query.get("v") != str(protocol.PROTOCOL_VERSION):
            await self.bye(ErrorCode.UNSUPPORTED_VERSION,
                           f"protocol version {query.get('v')!r} not supported; this server speaks "
                           f"v={protocol.PROTOCOL_VERSION}")
            return None
        spec = table.specs.get(env_name)
        if spec is None:
            await self.bye(ErrorCode.UNKNOWN_ENVIRONMENT,
                           f"no environment named {env_name!r}{did_you_mean(env_name, table.specs)} "
                           f"(hosted: {', '.join(table.specs)})")
            return None
        resume_id = query.get("session")
        if resume_id:
            session = table.get(resume_id)
            if session is None or session.spec is not spec:
                await self.bye(ErrorCode.SESSION_NOT_FOUND,
                               "no such session: it was closed, or expired after the resume grace period")
                return None
            table.metrics.sessions_resumed.labels(spec.name).inc()
        else:
            try:
                session = await table.open(spec)
            except Refused as exc:
                await self.bye(exc.code, str(exc))
                return None
            except Exception as exc:
                logger.exception("constructing %s failed", spec.name)
                await self.bye(ErrorCode.ENVIRONMENT_ERROR, f"environment constructor raised {_describe(exc)}")
                return None
        await table.attach(session, self)
        return session

    def _hello(self, session: Session, resumed: bool) -> str:
        spec = session.spec
        parts = self.table.hello_parts.get(spec.name)
        if parts is None:  # the fields that do not change between sessions, encoded once per environment
            config = self.table.config
            env = protocol.dumps({"env": spec.name})[1:-1]
            limits = protocol.dumps({"limits": {
                "call_timeout": config.call_timeout, "idle_timeout": config.idle_timeout,
                "resume_grace": config.resume_grace, "max_frame_bytes": config.max_frame_bytes}})[1:-1]
            parts = self.table.hello_parts[spec.name] = (env, f",{limits},{spec.describe_json[1:]}")
        # The session id is URL-safe base64, the rest numbers and literals: nothing to escape.
        return (f'{{"op":"{Op.HELLO}","v":{protocol.PROTOCOL_VERSION},"session":"{session.id}",{parts[0]},'
                f'"resumed":{"true" if resumed else "false"},"last_id":{session.last_id}{parts[1]}')

    async def _serve_frames(self, session: Session) -> None:
        receive, limit = self._receive, self.table.config.max_frame_bytes
        while session.alive and not self._closed:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            if text is None:
                reply = self._frame_error(None, ErrorCode.BAD_FRAME, "binary frames are not supported; send JSON text")
            elif len(text) > limit or (4 * len(text) > limit and len(text.encode()) > limit):
                reply = self._frame_error(None, ErrorCode.FRAME_TOO_LARGE,
                                          f"frame larger than {limit} bytes (max_frame_bytes)")
            else:
                reply = await self._request(session, text)
            await self._send(reply)
            if not session.alive and not self._closed:  # the request was `close`
                await self._close_socket()

    async def _request(self, session: Session, text: str) -> str:
        try:
            frame = protocol.loads(text)
        except ValueError as exc:
            return self._frame_error(None, ErrorCode.BAD_FRAME, f"not JSON: {exc}")
        except RecursionError:
            return self._frame_error(None, ErrorCode.BAD_FRAME, "JSON nested too deeply")
        if not isinstance(frame, dict):
            return self._frame_error(None, ErrorCode.BAD_FRAME, "a frame must be a JSON object")
        rid = frame.get("id")
        if type(rid) is not int or rid <= 0:
            return self._frame_error(None, ErrorCode.BAD_FRAME, "a request needs an integer 'id' > 0")
        if rid <= session.last_id:
            return await self._replay(session, rid)
        op = frame.get("op")
        handler = _OPS.get(op) if isinstance(op, str) else None
        if handler is None or not isinstance(op, str):
            return self._frame_error(rid, ErrorCode.UNKNOWN_OP,
                                     f"unknown op {op!r}; expected one of {', '.join(_OPS)}")
        return await self._run(session, rid, op, handler, frame)

    async def _replay(self, session: Session, rid: int) -> str:
        """A resent request (same id after a reconnect) gets the original reply; it never runs twice."""
        while session.last_id == rid and session.inflight is not None:
            await asyncio.shield(session.inflight)
        if session.last_id == rid:  # finished, and nothing ran since: its reply is the last one
            return session.last_reply
        return self._frame_error(rid, ErrorCode.BAD_FRAME,
                                 f"request id {rid} is below the last one ({session.last_id}); ids must increase")

    async def _run(self, session: Session, rid: int, op: str, handler: _Handler, frame: dict[str, Any]) -> str:
        loop = asyncio.get_running_loop()
        while session.inflight is not None:  # a request from a connection this one took over
            await asyncio.shield(session.inflight)
        if rid <= session.last_id:  # that connection ran this id (or a later one) meanwhile
            return await self._replay(session, rid)
        session.last_id = rid
        session.inflight = done = loop.create_future()
        tool = frame.get("tool", "") if op == Op.CALL else ""
        started = time.perf_counter()
        reply: str | None = None
        try:
            reply = ok_reply(rid, await handler(self, session, frame))
            outcome = "ok"
        except _RequestError as exc:
            reply, outcome = _error_reply(rid, exc.code, str(exc)), exc.code.value
        except Exception as exc:  # a bug of ours; the request still gets its one typed reply
            logger.exception("%s request %d of a %s session failed", op, rid, session.spec.name)
            reply = _error_reply(rid, ErrorCode.ENVIRONMENT_ERROR, f"internal server error: {_describe(exc)}")
            outcome = ErrorCode.ENVIRONMENT_ERROR.value
        finally:  # the reply is stored before anyone waiting to replay this id wakes up
            session.last_reply = reply if reply is not None else _error_reply(
                rid, ErrorCode.ENVIRONMENT_ERROR, "the request was interrupted (server shutting down)")
            session.last_active = loop.time()
            session.inflight = None
            done.set_result(None)
        if not isinstance(tool, str) or tool not in session.spec.tools:  # any JSON value: a list is unhashable
            tool = "<unknown>" if tool else ""  # keep metric label cardinality bounded
        self.table.metrics.request(session.spec.name, op, tool, outcome, time.perf_counter() - started)
        return reply

    async def _invoke(self, session: Session, func: Callable[..., Any], is_async: bool,
                      kwargs: dict[str, Any], failure: ErrorCode, what: str) -> Any:
        table = self.table
        try:
            return await session.invoke(func, is_async, kwargs, table.config.call_timeout)
        except SessionBusy as exc:
            raise _RequestError(ErrorCode.SESSION_BUSY, str(exc)) from None
        except TimeoutError:
            raise _RequestError(ErrorCode.CALL_TIMEOUT,
                                f"{what} did not finish within {table.config.call_timeout:g} s") from None
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # sys.exit() in a tool ends the call only
            raise _RequestError(failure, _describe(exc)) from None

    async def _reset(self, session: Session, frame: dict[str, Any]) -> str | None:
        if self.table.draining:
            raise _RequestError(ErrorCode.SERVER_DRAINING,
                                "server is draining before shutdown: open a new session elsewhere")
        kwargs = frame.get("kwargs", {})
        if not isinstance(kwargs, dict):
            raise _RequestError(ErrorCode.BAD_FRAME, "'kwargs' must be a JSON object")
        spec = session.spec
        prompt = await self._invoke(session, session.env.reset, spec.reset_is_async, kwargs,  # type: ignore[attr-defined]
                                    ErrorCode.ENVIRONMENT_ERROR, "reset")
        if prompt is not None and not isinstance(prompt, str):
            raise _RequestError(ErrorCode.ENVIRONMENT_ERROR,
                                f"reset returned {type(prompt).__name__}; expected str or None")
        if prompt is not None and not _encodable(prompt):
            raise _RequestError(ErrorCode.ENVIRONMENT_ERROR, "reset returned text that is not valid Unicode "
                                "(a lone surrogate); it cannot be sent as UTF-8")
        return prompt

    async def _call(self, session: Session, frame: dict[str, Any]) -> str:
        name, arguments = frame.get("tool"), frame.get("args", {})
        info = session.spec.tools.get(name) if isinstance(name, str) else None
        if info is None or not isinstance(name, str):
            raise _RequestError(ErrorCode.UNKNOWN_TOOL,
                                f"unknown tool {name!r}; available: {', '.join(session.spec.tools) or 'none'}")
        try:
            problem = info.validate(arguments)
        except RecursionError:
            problem = "arguments nested too deeply"
        if problem:
            raise _RequestError(ErrorCode.INVALID_ARGUMENTS, f"{name}: {problem}")
        value = await self._invoke(session, getattr(session.env, name), info.is_async, arguments,
                                   ErrorCode.TOOL_ERROR, f"tool {name}")
        try:
            text = protocol.render_result(value)
        except Exception as exc:
            raise _RequestError(ErrorCode.TOOL_ERROR, f"tool {name} returned a {type(value).__name__} "
                                f"whose str() raised {_describe(exc)}") from None
        if not _encodable(text):
            raise _RequestError(ErrorCode.TOOL_ERROR, f"tool {name} returned text that is not valid Unicode "
                                "(a lone surrogate); it cannot be sent as UTF-8")
        return text

    async def _reward(self, session: Session, frame: dict[str, Any]) -> float | None:
        spec = session.spec
        if not spec.has_reward:
            return None
        value = await self._invoke(session, session.env.get_reward, spec.reward_is_async, {},  # type: ignore[attr-defined]
                                   ErrorCode.ENVIRONMENT_ERROR, "get_reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _RequestError(ErrorCode.ENVIRONMENT_ERROR,
                                f"get_reward returned {type(value).__name__}; expected float")
        try:
            reward = float(value)
        except OverflowError:  # an int too large for a float
            reward = math.inf
        if not math.isfinite(reward):  # JSON has no NaN or Infinity
            raise _RequestError(ErrorCode.ENVIRONMENT_ERROR, f"get_reward returned {reward}; expected a finite float")
        return reward

    async def _ping(self, session: Session, frame: dict[str, Any]) -> str:
        return "pong"

    async def _close(self, session: Session, frame: dict[str, Any]) -> None:
        await self.table.end(session, "closed")

    def _frame_error(self, rid: int | None, code: ErrorCode, message: str) -> str:
        self.table.metrics.frame_errors.labels(code.value).inc()
        return _error_reply(rid, code, message)

    async def _send(self, text: str) -> None:
        try:
            await self._asgi_send({"type": "websocket.send", "text": text})
        except (RuntimeError, OSError):  # the peer is gone (uvicorn's ClientDisconnected); receive() will tell
            self._closed = True


_Handler = Callable[[Connection, Session, dict[str, Any]], Awaitable[Any]]
_OPS: dict[str, _Handler] = {
    Op.RESET: Connection._reset, Op.CALL: Connection._call, Op.REWARD: Connection._reward,
    Op.PING: Connection._ping, Op.CLOSE: Connection._close,
}


def _parse_query(query: str) -> dict[str, str]:
    """The query string's parameters (the last of a repeated name wins, as ``dict(parse_qsl())``)."""
    if "%" in query or "+" in query:  # escaped: let the standard parser decode it
        return dict(urllib.parse.parse_qsl(query))
    pairs = (pair.partition("=") for pair in query.split("&") if pair)
    return {name: value for name, _, value in pairs if value}


def _describe(exc: BaseException) -> str:
    """``"ValueError: message"``, the text a model sees for a failed tool."""
    try:
        text = str(exc)
    except Exception as inner:  # an exception whose __str__ raises
        text = f"<str() of the exception raised {type(inner).__name__}>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _encodable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogate, which JSON text can carry)."""
    if text.isascii():  # O(1) in CPython
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _wire_text(message: str) -> str:
    """``message`` with any lone surrogate written as a ``\\udXXX`` escape, so that it encodes."""
    return message if _encodable(message) else message.encode("utf-8", "backslashreplace").decode()


def _error_reply(rid: int | None, code: ErrorCode, message: str) -> str:
    """A failed reply whose message is safe to encode (it may echo what the peer sent)."""
    return error_reply(rid, code, _wire_text(message))
