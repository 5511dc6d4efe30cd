"""The rollout worker process: its channels to the trainer, its entry point, and the trainer's handle.

The worker is a *spawned* process with ``CUDA_VISIBLE_DEVICES=""`` running one
:class:`~trainer.rollout.loop.AsyncRolloutLoop` on an asyncio loop. It talks to the trainer only
through :class:`WorkerChannels`: a queue of scored groups, a queue of metric records, a queue for
its traceback, shared values (policy version, token allowance, tokens consumed, heartbeat) and two
events (failed, stop). :class:`RolloutWorker` is the trainer's side: start, take groups (raising
:class:`~trainer.exceptions.RolloutWorkerError` with the worker's traceback within a second of a crash,
or after ``rollout_worker_timeout`` without a heartbeat), stop (never leaving a process behind).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.exceptions import RolloutWorkerError
from trainer.records import QueuedGroup

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

POLL_S = 0.5


@dataclass
class WorkerChannels:
    """Everything shared between the trainer and the worker process (all picklable for spawn)."""

    rollout_buffer: Queue[QueuedGroup]
    metrics_queue: Queue[list[Any]]  # batches of metric records
    exception_queue: Queue[str]  # the worker's traceback
    model_version: Any
    token_allowance: Any
    consumed_tokens: Any
    heartbeat: Any
    failed: Any
    stop: Any
    queued_samples: Any  # training samples the worker has put on rollout_buffer (only the worker writes it)
    epoch_size: Any  # prompts per epoch; 0 until known (a stream's size is known after its first pass)

    @classmethod
    def create(cls, ctx: Any, initial_allowance: int, initial_version: int, epoch_size: int = 0) -> WorkerChannels:
        """Make the queues, values and events in multiprocessing context ``ctx`` (``epoch_size``: the
        dataset's size when known, 0 for a stream or no dataset)."""
        return cls(
            rollout_buffer=ctx.Queue(),
            metrics_queue=ctx.Queue(),
            exception_queue=ctx.Queue(),
            model_version=ctx.Value("q", initial_version, lock=False),
            token_allowance=ctx.Value("q", initial_allowance, lock=False),
            consumed_tokens=ctx.Value("q", 0, lock=False),
            heartbeat=ctx.Value("d", time.time(), lock=False),
            failed=ctx.Event(),
            stop=ctx.Event(),
            queued_samples=ctx.Value("q", 0, lock=False),
            epoch_size=ctx.Value("q", epoch_size, lock=False),
        )


def worker_main(loop_cls: type, loop_kwargs: dict[str, Any], channels: WorkerChannels) -> None:
    """Entry point of the spawned process: build the loop and run it until stopped or failed."""
    import asyncio

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        loop = loop_cls(channels=channels, **loop_kwargs)
        asyncio.run(loop.run())
    except BaseException:  # everything, KeyboardInterrupt included, must reach the trainer
        channels.exception_queue.put(traceback.format_exc())
        channels.failed.set()


class RolloutWorker:
    """The trainer's handle on the worker process.

    Args:
        loop_cls: The :class:`~trainer.rollout.loop.AsyncRolloutLoop` (sub)class to run.
        loop_kwargs: Its constructor arguments (must pickle).
        channels: Created with :meth:`WorkerChannels.create` in the same spawn context.
        timeout_s: ``rollout_worker_timeout``: seconds without a heartbeat before the worker counts as hung.
    """

    def __init__(self, loop_cls: type, loop_kwargs: dict[str, Any], channels: WorkerChannels, timeout_s: float,
                 ctx: Any) -> None:
        self.channels = channels
        self.timeout_s = timeout_s
        self.process = ctx.Process(target=worker_main, args=(loop_cls, loop_kwargs, channels),
                                   name="toolgym-rollout-worker", daemon=True)

    def start(self) -> None:
        """Spawn the process (hiding the GPUs from it)."""
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            self.process.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        self.channels.heartbeat.value = time.time()

    def check(self) -> None:
        """Raise :class:`RolloutWorkerError` if the worker failed, died or stopped beating."""
        if self.channels.failed.is_set():
            raise RolloutWorkerError(f"the rollout worker failed:\n{self._traceback()}")
        if not self.process.is_alive():
            raise RolloutWorkerError(
                f"the rollout worker died (exit code {self.process.exitcode}) without a traceback:\n"
                f"{self._traceback()}")
        silent = time.time() - self.channels.heartbeat.value
        if silent > self.timeout_s:
            raise RolloutWorkerError(
                f"the rollout worker sent no heartbeat for {silent:.0f} s (rollout_worker_timeout="
                f"{self.timeout_s:.0f}); it is hung (a blocking call on its event loop?) and was stopped")

    def _traceback(self) -> str:
        try:
            return self.channels.exception_queue.get(timeout=2.0)
        except queue.Empty:
            return "(no traceback was received)"

    def get(self, timeout_s: float | None = None) -> QueuedGroup | None:
        """Next group from the queue, checking the worker's health while waiting.

        Returns ``None`` when ``timeout_s`` passes with nothing queued.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return self.channels.rollout_buffer.get(timeout=POLL_S)
            except queue.Empty:
                self.check()
                if deadline is not None and time.monotonic() > deadline:
                    return None

    def queued_samples(self) -> int:
        """Training samples the worker has queued since it started (``rollout/queue_size`` counts samples)."""
        return int(self.channels.queued_samples.value)

    def epoch_size(self) -> int | None:
        """Prompts per epoch, ``None`` until known (a stream's first pass has not ended yet)."""
        return int(self.channels.epoch_size.value) or None

    def add_consumed_tokens(self, tokens: int) -> None:
        """Tell the worker's staleness allowance that the trainer took ``tokens`` more off the queue."""
        self.channels.consumed_tokens.value += tokens

    def qsize(self) -> int:
        """Groups waiting in the queue (approximate)."""
        try:
            return self.channels.rollout_buffer.qsize()
        except NotImplementedError:  # macOS
            return 0

    def drain_metrics(self) -> list[Any]:
        """Every metric record the worker sent since the last call."""
        records: list[Any] = []
        while True:
            try:
                records.extend(self.channels.metrics_queue.get_nowait())
            except queue.Empty:
                return records

    def _discard_pending(self) -> None:
        for q in (self.channels.rollout_buffer, self.channels.metrics_queue):
            try:
                while True:
                    q.get_nowait()
            except (queue.Empty, OSError, EOFError):
                pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to stop, then terminate/kill it if it does not; idempotent.

        What the worker still sends is discarded (the run is over), and that is what lets it exit:
        a process that put items on a queue exits only after its feeder threads have written them
        into the pipe, which blocks while the pipe is full and no one reads. Joining without
        reading waited out the whole ``timeout_s`` after most runs.
        """
        if self.process.pid is None:
            return
        self.channels.stop.set()
        deadline = time.monotonic() + timeout_s
        while self.process.is_alive() and time.monotonic() < deadline:
            self._discard_pending()
            self.process.join(0.05)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        for q in (self.channels.rollout_buffer, self.channels.metrics_queue, self.channels.exception_queue):
            q.cancel_join_thread()
            q.close()


def spawn_context() -> Any:
    """The multiprocessing context for the worker (always spawn: no forked CUDA or threads)."""
    return mp.get_context("spawn")
