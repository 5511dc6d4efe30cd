"""A weight sync on a thread of its own, overlapping the next step's forward and backward.

A sync only reads the weights, and nothing changes them until the next optimizer step, so the
training process can go on with the next step (waiting for rollouts, forward, backward) while
the sync runs; it waits for the sync just before that optimizer step (and before a checkpoint
save and at the end of training). It is used where the server takes the whole update in one
engine call (``weight_sync_pause="none"``), so generation is not paused either; a pausing sync
overlapped with training would hold the server paused for as long as the step takes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from trainer.sync.weight_sync import SyncTimings


@dataclass
class FinishedSync:
    """What :meth:`BackgroundSync.wait` returns: the sync's phases, its duration and the wait."""

    timings: SyncTimings
    duration_s: float  # from its start to its end, on its thread
    waited_s: float  # how long the training loop blocked on it


class BackgroundSync:
    """Runs one sync at a time on a worker thread; :meth:`wait` joins it and re-raises its error."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="toolgym-weight-sync")
        self._pending: Future[tuple[SyncTimings, float]] | None = None

    @property
    def pending(self) -> bool:
        """Whether a sync was started and not yet waited for."""
        return self._pending is not None

    def start(self, sync: Callable[[], SyncTimings]) -> None:
        """Run ``sync()`` on the thread; a sync must not be pending (``wait`` for it first)."""
        if self._pending is not None:
            raise RuntimeError("a weight sync is already pending: wait() for it first")
        started = time.perf_counter()

        def run() -> tuple[SyncTimings, float]:
            timings = sync()
            return timings, time.perf_counter() - started

        self._pending = self._pool.submit(run)

    def wait(self) -> FinishedSync | None:
        """Block until the pending sync ends; ``None`` when none is pending. Raises what it raised."""
        if self._pending is None:
            return None
        future, self._pending = self._pending, None
        t0 = time.perf_counter()
        timings, duration_s = future.result()
        return FinishedSync(timings, duration_s, time.perf_counter() - t0)

    def close(self) -> None:
        """Wait for a pending sync (its error, if any, is dropped: the run is ending) and stop the thread."""
        if self._pending is not None:
            self._pending.exception()
            self._pending = None
        self._pool.shutdown(wait=True)
