"""A weight sync on a thread of its own, overlapping the next step.

A sync reads the weights only while it stages them (the ``toolgym_shm`` backend writes every chunk
to shared memory before the server loads any), and nothing changes them until the next optimizer
step. So the training process goes on with the next step (waiting for rollouts, forward,
backward) while the sync runs, and before that optimizer step it waits only until the sync has
read the weights (:meth:`BackgroundSync.wait_for_read`); the server's part of the sync goes on
meanwhile. It is used where the server takes the whole update in one engine call
(``weight_sync_pause="none"``), so generation is not paused either: a pausing sync overlapped with
training would hold the server paused for as long as the step takes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from trainer.sync.weight_sync import SyncTimings

ReadDone = Callable[[], None]
"""Called by a sync once it holds its own copy of the weights (they may change from then on)."""


@dataclass
class FinishedSync:
    """A sync that ended: its phases and its duration on its thread."""

    timings: SyncTimings
    duration_s: float


class BackgroundSync:
    """Runs one sync at a time on a worker thread; its error is raised where the caller waits."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="toolgym-weight-sync")
        self._pending: Future[FinishedSync] | None = None
        self._read = threading.Event()

    @property
    def pending(self) -> bool:
        """Whether a sync was started and not yet collected."""
        return self._pending is not None

    def start(self, sync: Callable[[ReadDone], SyncTimings]) -> None:
        """Run ``sync(read_done)`` on the thread; a sync must not be pending (:meth:`collect` it first)."""
        if self._pending is not None:
            raise RuntimeError("a weight sync is already pending: collect() it first")
        started = time.perf_counter()
        self._read.clear()

        def run() -> FinishedSync:
            timings = sync(self._read.set)
            return FinishedSync(timings, time.perf_counter() - started)

        self._pending = self._pool.submit(run)
        # Also set once the future holds its outcome: a sync that failed before reading is then seen
        # as failed by wait_for_read (a `finally` in run() would wake it before the future is done).
        self._pending.add_done_callback(lambda _: self._read.set())

    def wait_for_read(self) -> float:
        """Block until the pending sync no longer reads the weights; the seconds blocked (0 when none
        is pending). Raises the sync's error if it failed by then."""
        if self._pending is None:
            return 0.0
        t0 = time.perf_counter()
        self._read.wait()
        if self._pending.done() and self._pending.exception() is not None:
            self.collect()
        return time.perf_counter() - t0

    def collect(self, block: bool = True) -> FinishedSync | None:
        """The pending sync once it ended (waiting for it with ``block``), else ``None``. Raises what it raised."""
        if self._pending is None or not (block or self._pending.done()):
            return None
        future, self._pending = self._pending, None
        return future.result()

    def close(self) -> None:
        """Wait for a pending sync (its error, if any, is dropped: the run is ending) and stop the thread."""
        if self._pending is not None:
            self._pending.exception()
            self._pending = None
        self._pool.shutdown(wait=True)
