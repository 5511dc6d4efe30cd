"""The thread pool for sync environment methods, with batched hand-offs between loop and threads.

``loop.run_in_executor`` costs two thread wake-ups per call (one to start it, one self-pipe write
to return the result): on a small VM that is most of a trivial tool call's cost. Here every
submission still gets a worker of its own (a sleeping one is woken, or a new one started, up to the
limit), so one slow method never holds up the jobs queued behind it; but a worker drains every
queued job before it sleeps, and results go back to the loop in one callback per batch, so under
load most hand-offs cost no wake-up at all.

Even a batched hand-off costs more than a trivial method itself (a counter's ``increment`` takes
microseconds), so the pool also learns which callables are that cheap (``InlinePolicy``) and runs
those on the loop directly; any callable that ever runs long goes back to the threads.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_MAX_BACKOFF = 1 << 10


class Job:
    """One submitted call: ``future`` resolves on the loop; ``finished`` flips when the thread is done."""

    __slots__ = ("future", "func", "kwargs", "finished", "elapsed")

    def __init__(self, future: asyncio.Future[Any], func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.future = future
        self.func = func
        self.kwargs = kwargs
        self.finished = False
        self.elapsed = 0.0  # wall seconds the call took on its thread, once finished


def _key(func: Callable[..., Any]) -> object:
    """What a callable is known by: a bound method by its function, so all instances share it."""
    return getattr(func, "__func__", func)


class InlinePolicy:
    """Learns which sync callables are cheap enough to run on the event loop itself.

    A callable starts in the pool. Once ``promote_after`` runs in a row each took under
    ``threshold`` seconds (wall time, measured on the worker thread) it runs inline, on the loop.
    An inline run that takes ``threshold`` or more sends it back to the pool, where it must show
    twice as many fast runs in a row as last time before it is inlined again; a callable that
    keeps running long thus stays in the pool. Only the loop thread calls these methods.

    The price of inlining is bounded but not zero: the one run that turns out slow stalls the loop
    for its duration, and the per-call deadline cannot interrupt it.

    Args:
        threshold: Seconds under which a run counts as fast.
        promote_after: Fast runs in a row needed before a callable is first inlined.
    """

    def __init__(self, threshold: float, promote_after: int = 16) -> None:
        if threshold <= 0 or promote_after < 1:
            raise ValueError(f"InlinePolicy needs threshold > 0 and promote_after >= 1, "
                             f"got {threshold} and {promote_after}")
        self.threshold = threshold
        self.promote_after = promote_after
        self._inline: set[object] = set()
        self._streak: dict[object, int] = {}  # fast pool runs in a row, per callable
        self._needed: dict[object, int] = {}  # runs in a row needed, once demoted

    def inline(self, func: Callable[..., Any]) -> bool:
        """Whether ``func`` runs on the loop."""
        return _key(func) in self._inline

    def record(self, func: Callable[..., Any], seconds: float, inline: bool) -> None:
        """Account one finished run of ``func`` that took ``seconds`` (``inline``: on the loop)."""
        key = _key(func)
        if seconds < self.threshold:
            if not inline:
                streak = self._streak[key] = self._streak.get(key, 0) + 1
                if streak >= self._needed.get(key, self.promote_after):
                    self._inline.add(key)
            return
        self._streak[key] = 0
        if inline:
            self._inline.discard(key)
            needed = self._needed.get(key, self.promote_after)
            self._needed[key] = min(2 * needed, _MAX_BACKOFF * self.promote_after)

    def run(self, func: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """Call ``func(**kwargs)`` on the loop thread, timing it."""
        started = time.perf_counter()
        try:
            return func(**kwargs)
        finally:
            self.record(func, time.perf_counter() - started, inline=True)


class SyncPool:
    """Up to ``workers`` threads (started on demand) running sync callables for one event loop.

    Args:
        workers: Most threads at once.
        name: Thread name prefix.
        policy: Learns from every finished job which callables may run inline (``run`` and
            ``Session.invoke`` ask it); ``None`` sends every call to a thread.
    """

    def __init__(self, workers: int, name: str = "toolgym-env", policy: InlinePolicy | None = None) -> None:
        self.policy = policy
        self._max_workers = workers
        self._name = name
        # A C queue and deque instead of a ``threading.Condition`` (pure Python: a lock per wait and
        # its notify): 2.1-3.4 us of CPU per job instead of 3.6-5.8 us, 1,024 callers on one core.
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # One token per worker that is free (or about to be) and not yet claimed by a submission;
        # ``append`` and ``pop`` are atomic, so the loop and the workers need no lock to count.
        self._free: collections.deque[None] = collections.deque()
        self._results: collections.deque[tuple[Job, Any, BaseException | None]] = collections.deque()
        self._owed = 0  # jobs queued when no worker was free; only the loop thread counts them
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._delivery_scheduled = False

    def submit(self, func: Callable[..., Any], **kwargs: Any) -> Job:
        """Queue ``func(**kwargs)``; await ``job.future`` on the calling loop for its result."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        job = Job(self._loop.create_future(), func, kwargs)
        # Every job gets a worker of its own: a free one claimed for it, or a new one started. Jobs
        # queued while every worker was busy are taken first (FIFO), so they use up the next tokens.
        free = self._free
        try:
            while self._owed:
                free.pop()
                self._owed -= 1
            free.pop()
        except IndexError:
            if len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            else:
                self._owed += 1
        self._jobs.put(job)
        return job

    async def run(self, func: Callable[..., Any], **kwargs: Any) -> Any:
        """``await`` the result of ``func(**kwargs)`` (inline when the policy says so)."""
        policy = self.policy
        if policy is not None and policy.inline(func):
            return policy.run(func, kwargs)
        return await self.submit(func, **kwargs).future

    def shutdown(self) -> None:
        """Let the workers exit once the queue is empty (running calls are not interrupted)."""
        for _ in self._threads:
            self._jobs.put(None)  # after every queued job: each worker takes one and exits

    def _work(self) -> None:
        jobs, free, results = self._jobs, self._free, self._results
        while True:
            job = jobs.get()  # a queued job at once (the queue is drained before sleeping), else sleep
            if job is None:
                return
            started = time.perf_counter()
            try:
                outcome: tuple[Job, Any, BaseException | None] = (job, job.func(**job.kwargs), None)
            except BaseException as exc:  # handed to the awaiting coroutine, as run_in_executor does
                outcome = (job, None, exc)
            job.elapsed = time.perf_counter() - started
            job.finished = True
            results.append(outcome)
            free.append(None)  # before the next get(): a job submitted from now on may count on this worker
            if not self._delivery_scheduled:
                self._delivery_scheduled = True
                assert self._loop is not None
                try:
                    self._loop.call_soon_threadsafe(self._deliver)
                except RuntimeError:  # the loop is closed: the server is gone, nobody awaits
                    return

    def _deliver(self) -> None:
        self._delivery_scheduled = False  # before draining: a result appended later schedules anew
        policy = self.policy
        while self._results:
            job, result, exc = self._results.popleft()
            if policy is not None:
                policy.record(job.func, job.elapsed, inline=False)
            if job.future.done():  # cancelled by a deadline
                continue
            if exc is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(exc)
