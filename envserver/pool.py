"""The thread pool for sync environment methods, with batched hand-offs between loop and threads.

``loop.run_in_executor`` costs two thread wake-ups per call (one to start it, one self-pipe write
to return the result): on a small VM that is most of a trivial tool call's cost. Here every
submission still gets a worker of its own (a sleeping one is woken, or a new one started, up to the
limit), so one slow method never holds up the jobs queued behind it; but a worker drains every
queued job before it sleeps, and results go back to the loop in one callback per batch, so under
load most hand-offs cost no wake-up at all.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from typing import Any


class Job:
    """One submitted call: ``future`` resolves on the loop; ``finished`` flips when the thread is done."""

    __slots__ = ("future", "func", "kwargs", "finished")

    def __init__(self, future: asyncio.Future[Any], func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.future = future
        self.func = func
        self.kwargs = kwargs
        self.finished = False


class SyncPool:
    """Up to ``workers`` threads (started on demand) running sync callables for one event loop."""

    def __init__(self, workers: int, name: str = "toolgym-env") -> None:
        self._max_workers = workers
        self._name = name
        self._jobs: collections.deque[Job] = collections.deque()
        self._results: collections.deque[tuple[Job, Any, BaseException | None]] = collections.deque()
        self._wakeup = threading.Condition(threading.Lock())
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._delivery_scheduled = False

    def submit(self, func: Callable[..., Any], **kwargs: Any) -> Job:
        """Queue ``func(**kwargs)``; await ``job.future`` on the calling loop for its result."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        job = Job(self._loop.create_future(), func, kwargs)
        self._jobs.append(job)
        with self._wakeup:
            if self._idle:  # every job gets a worker of its own, woken or started for it
                self._idle -= 1  # counted here, not by the woken thread: the next job wakes another
                self._wakeup.notify()
            elif len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return job

    async def run(self, func: Callable[..., Any], **kwargs: Any) -> Any:
        """``await`` the result of ``func(**kwargs)`` run on a worker thread."""
        return await self.submit(func, **kwargs).future

    def shutdown(self) -> None:
        """Let the workers exit once the queue is empty (running calls are not interrupted)."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify_all()

    def _work(self) -> None:
        while True:
            with self._wakeup:
                while not self._jobs:
                    if self._closed:
                        return
                    self._idle += 1
                    self._wakeup.wait()
                job = self._jobs.popleft()
            try:
                outcome: tuple[Job, Any, BaseException | None] = (job, job.func(**job.kwargs), None)
            except BaseException as exc:  # handed to the awaiting coroutine, as run_in_executor does
                outcome = (job, None, exc)
            job.finished = True
            self._results.append(outcome)
            if not self._delivery_scheduled:
                self._delivery_scheduled = True
                assert self._loop is not None
                try:
                    self._loop.call_soon_threadsafe(self._deliver)
                except RuntimeError:  # the loop is closed: the server is gone, nobody awaits
                    return

    def _deliver(self) -> None:
        self._delivery_scheduled = False  # before draining: a result appended later schedules anew
        while self._results:
            job, result, exc = self._results.popleft()
            if job.future.done():  # cancelled by a deadline
                continue
            if exc is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(exc)
