"""The session table: capacity with a bounded wait queue, resume by id, idle reaping, drain.

A session is one environment instance plus the bookkeeping that lets a client drop its connection
and resume: the id of the last request it sent and the reply to it (replayed, never re-run, when
the client resends that request after reconnecting).

Each environment class has its own thread pool (``SessionTable.pools``): the sync methods and
constructors of one class share at most ``ServerConfig.threads`` threads, so slow tools of one
environment (a sandbox running commands) never hold up another environment's sessions.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from collections.abc import Callable
from typing import Any, Protocol

from envserver.config import ServerConfig
from envserver.exceptions import EnvServerError
from envserver.metrics import ServerMetrics
from envserver.pool import Job, SyncPool
from envserver.registry import EnvSpec
from sdk.protocol import ErrorCode

logger = logging.getLogger("envserver.sessions")


class Refused(EnvServerError):
    """A new session cannot be opened; carries the protocol error to send back."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class SessionBusy(EnvServerError):
    """A sync call that ran past its deadline is still running on this session's environment."""


class Peer(Protocol):
    """The connection a session is attached to, as the table sees it."""

    async def bye(self, code: ErrorCode, message: str) -> None:
        """Tell the client why its session ends, then close the connection."""
        ...


class Session:
    """One environment instance and its resume bookkeeping."""

    __slots__ = ("id", "spec", "env", "pool", "peer", "last_active", "detached_at", "last_id", "last_reply",
                 "inflight", "stray", "alive")

    def __init__(self, spec: EnvSpec, env: object, now: float, pool: SyncPool | None = None) -> None:
        self.id = secrets.token_urlsafe(16)  # also the resume capability: unguessable
        self.spec = spec
        self.env = env
        self.pool = pool  # the environment class's thread pool; None runs sync methods on the loop
        self.peer: Peer | None = None
        self.last_active = now
        self.detached_at = now
        self.last_id = 0  # the id of the last request run; ``last_reply`` is its reply once it finished
        self.last_reply = ""
        self.inflight: asyncio.Future[None] | None = None  # set while a request runs
        self.stray: Job | None = None  # a sync call that ran past its deadline
        self.alive = True

    async def invoke(self, func: Callable[..., Any], is_async: bool, kwargs: dict[str, Any], timeout: float) -> Any:
        """Run one environment method under the deadline: async on the loop, sync in the pool.

        With no pool (``ServerConfig.inline_sync``), or when the pool's ``InlinePolicy`` has
        found the method cheap, a sync method runs on the loop itself and the deadline cannot
        interrupt it.

        Raises:
            SessionBusy: an earlier sync call that timed out is still running.
            TimeoutError: the method ran past ``timeout`` seconds.
            Exception: whatever the method raised.
        """
        if self.stray is not None:
            if not self.stray.finished:
                raise SessionBusy("an earlier call is still running past its deadline; retry later")
            self.stray = None
        if is_async:
            return await asyncio.wait_for(func(**kwargs), timeout)
        pool = self.pool
        if pool is None:
            return func(**kwargs)
        policy = pool.policy
        if policy is not None and policy.inline(func):
            return policy.run(func, kwargs)
        job = pool.submit(func, **kwargs)
        # A timer on the job's own future: what wait_for does, without its extra future and task hops.
        deadline = asyncio.get_running_loop().call_later(timeout, _expire, job.future)
        try:
            return await job.future
        except TimeoutError:
            self.stray = job  # a thread cannot be cancelled; later requests wait for it
            raise
        finally:
            deadline.cancel()


def _expire(future: asyncio.Future[Any]) -> None:
    """Fail a pool job's future with ``TimeoutError`` unless it already has its result."""
    if not future.done():
        future.set_exception(TimeoutError())


class _Slots:
    """A counting semaphore whose waiters queue FIFO, with a bound on the queue and on the wait."""

    def __init__(self, limit: int, max_waiting: int, metrics: ServerMetrics) -> None:
        self.limit = limit
        self.max_waiting = max_waiting
        self.used = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._metrics = metrics

    @property
    def waiting(self) -> int:
        """Sessions queued for a slot."""
        return len(self._waiters)

    async def acquire(self, timeout: float) -> None:
        """Take a slot, queueing up to ``timeout`` seconds. Raises ``Refused`` (server_full)."""
        if self.used < self.limit and not self._waiters:
            self.used += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise Refused(ErrorCode.SERVER_FULL, f"server full: {self.used} sessions open and "
                          f"{len(self._waiters)} waiting (limits {self.limit} and {self.max_waiting})")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._metrics.sessions_waiting.set(len(self._waiters))
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot just as we were cancelled: pass it on
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
                self._waiters.remove(waiter)
            self._metrics.sessions_waiting.set(len(self._waiters))
        if waiter.cancelled():
            raise Refused(ErrorCode.SERVER_FULL, f"server full: no session slot freed within {timeout:g} s")

    def release(self) -> None:
        """Free a slot, handing it straight to the oldest waiter if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.used -= 1


class SessionTable:
    """All sessions of one server, the capacity limit, the reaper and the drain."""

    def __init__(self, config: ServerConfig, specs: dict[str, EnvSpec], metrics: ServerMetrics,
                 pools: dict[str, SyncPool] | None) -> None:
        self.config = config
        self.specs = specs
        self.metrics = metrics
        self.pools = pools  # environment name -> its thread pool; None with inline_sync
        self.draining = False
        self._sessions: dict[str, Session] = {}
        self.hello_parts: dict[str, tuple[str, str]] = {}  # environment -> pre-encoded hello fields (Connection)
        self._slots = _Slots(config.max_sessions, config.max_waiting, metrics)

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def waiting(self) -> int:
        """New sessions queued for a free slot."""
        return self._slots.waiting

    def get(self, session_id: str) -> Session | None:
        """The live session with this id, if any."""
        return self._sessions.get(session_id)

    async def open(self, spec: EnvSpec) -> Session:
        """Wait for a slot and make a new session (the constructor runs like a sync method).

        Raises:
            Refused: draining, or full past the queue bound or the queue timeout.
            Exception: whatever the environment's constructor raised.
        """
        if self.draining:
            self.metrics.sessions_rejected.labels("server_draining").inc()
            raise Refused(ErrorCode.SERVER_DRAINING, "server is draining before shutdown; use another replica")
        try:
            await self._slots.acquire(self.config.queue_timeout)
        except Refused:
            self.metrics.sessions_rejected.labels("server_full").inc()
            raise
        loop = asyncio.get_running_loop()
        pool = None if self.pools is None else self.pools[spec.name]
        try:
            env = spec.factory() if pool is None else await pool.run(spec.factory)
        except BaseException:
            self._slots.release()
            raise
        session = Session(spec, env, loop.time(), pool)
        self._sessions[session.id] = session
        self.metrics.session_opened(spec.name)
        return session

    async def attach(self, session: Session, peer: Peer) -> None:
        """Attach ``peer`` to ``session``; a peer still attached is told and disconnected (takeover)."""
        previous, session.peer = session.peer, peer
        session.last_active = asyncio.get_running_loop().time()
        if previous is not None and previous is not peer:
            await previous.bye(ErrorCode.SESSION_EVICTED, "session resumed from another connection")

    def detach(self, session: Session, peer: Peer) -> None:
        """``peer``'s connection ended: the session stays resumable for ``resume_grace`` seconds."""
        if session.peer is peer:
            session.peer = None
            session.detached_at = asyncio.get_running_loop().time()

    async def end(self, session: Session, reason: str) -> None:
        """Destroy a session (idempotent) and free its slot; ``reason`` other than closed counts as eviction."""
        if self._sessions.pop(session.id, None) is None:
            return
        session.alive = False
        session.peer = None
        self._slots.release()
        self.metrics.session_ended(session.spec.name, reason)
        close = getattr(session.env, "close", None)
        if callable(close):
            await self._close_env(session, close)

    async def _close_env(self, session: Session, close: Callable[[], Any]) -> None:
        try:
            if asyncio.iscoroutinefunction(close):
                await asyncio.wait_for(close(), self.config.call_timeout)
            elif session.pool is None:
                close()
            else:
                await asyncio.wait_for(session.pool.run(close), self.config.call_timeout)
        except Exception:
            logger.exception("close() of a %s session raised", session.spec.name)

    async def evict(self, session: Session, code: ErrorCode, message: str, reason: str) -> None:
        """End a session on the server's initiative, telling its client why."""
        peer = session.peer
        await self.end(session, reason)
        if peer is not None:
            await peer.bye(code, message)

    async def reap_forever(self) -> None:
        """Every ``reap_interval``: evict idle attached sessions, destroy expired detached ones."""
        config = self.config
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(config.reap_interval)
            now = loop.time()
            for session in list(self._sessions.values()):
                if session.peer is None:
                    if now - session.detached_at > config.resume_grace:
                        await self.end(session, "expired")
                elif session.inflight is None and now - session.last_active > config.idle_timeout:
                    await self.evict(session, ErrorCode.SESSION_EVICTED,
                                     f"idle for more than {config.idle_timeout:g} s", "idle")

    async def drain(self) -> None:
        """Refuse new sessions, give open ones ``drain_timeout`` seconds to end, then evict the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout
        while self._sessions and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.evict_all()

    async def evict_all(self) -> None:
        """Evict every session (``server_draining``): the server is going away."""
        for session in list(self._sessions.values()):
            await self.evict(session, ErrorCode.SERVER_DRAINING, "server shut down", "drain")
