"""The rollout worker process: its channels to the trainer, its entry point, and the trainer's handle.

The worker is a *spawned* process with ``CUDA_VISIBLE_DEVICES=""`` running one
:class:`~trainer.rollout.loop.AsyncRolloutLoop` on an asyncio loop, built from a
:class:`~trainer.rollout.settings.RolloutSettings`. It talks to the trainer only through
:class:`WorkerChannels`: a queue of scored groups, a queue of metric records, a queue for its
traceback, shared values (policy version, token allowance, tokens consumed, heartbeat) and two
events (failed, stop). :class:`RolloutWorker` is the trainer's side: start, take groups (raising
:class:`~trainer.exceptions.RolloutWorkerError` with the worker's traceback within a second of a crash,
or after ``rollout_worker_timeout`` without a heartbeat), stop (never leaving a process behind).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass
from multiprocessing.context import BaseContext, SpawnContext
from typing import TYPE_CHECKING, Any

from trainer.exceptions import PipelineStalledError, RolloutWorkerError
from trainer.metrics import Record
from trainer.records import QueuedGroup
from trainer.rollout.eval_in_training import EvalReply, EvalRequest, evaluation_loop, run_with_evaluations
from trainer.vllm.fleet import FleetState

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event

    from trainer.rollout.loop import AsyncRolloutLoop
    from trainer.rollout.settings import RolloutSettings

logger = logging.getLogger(__name__)

POLL_S = 0.5
HEARTBEAT_S = 1.0
STOP_POLL_S = 0.1


@dataclass
class WorkerChannels:
    """Everything shared between the trainer and the worker process (all picklable for spawn).

    The shared values have one writer each (no lock): the trainer writes ``policy_version``,
    ``token_allowance`` and ``consumed_tokens``; the worker the others.

    Attributes:
        rollout_buffer: Scored groups, worker -> trainer.
        metrics_queue: Batches of metric records, worker -> trainer.
        exception_queue: The worker's traceback when it fails.
        policy_version: The newest policy version; new groups start under it.
        token_allowance: Sample tokens the worker may hold queued or in flight (the staleness allowance).
        consumed_tokens: Sample tokens the trainer has taken off the queue since the start.
        heartbeat: ``time.time()`` of the worker's event loop's last beat.
        failed: Set by the worker when it fails (its traceback is on ``exception_queue``).
        stop: Set by the trainer to stop the worker.
        queued_samples: Training samples the worker has put on ``rollout_buffer``.
        epoch_size: Prompts per epoch; 0 until known (a stream's size is known after its first pass).
        eval_requests: Evaluations to run, trainer -> worker (:mod:`trainer.rollout.eval_in_training`).
        eval_results: Their episodes, worker -> trainer.
        fleet: Which vLLM servers hold which policy version (:mod:`trainer.vllm.fleet`): the trainer
            writes each server's version as it syncs it, the worker which servers it took out.
    """

    rollout_buffer: Queue[QueuedGroup]
    metrics_queue: Queue[list[Record]]
    exception_queue: Queue[str]
    policy_version: ctypes.c_int64
    token_allowance: ctypes.c_int64
    consumed_tokens: ctypes.c_int64
    heartbeat: ctypes.c_double
    failed: Event
    stop: Event
    queued_samples: ctypes.c_int64
    epoch_size: ctypes.c_int64
    eval_requests: Queue[EvalRequest]
    eval_results: Queue[EvalReply]
    fleet: FleetState

    @classmethod
    def create(cls, ctx: BaseContext, initial_allowance: int, initial_version: int,
               epoch_size: int = 0, fleet: FleetState | None = None) -> WorkerChannels:
        """Make the queues, values and events in multiprocessing context ``ctx`` (``epoch_size``: the
        dataset's size when known, 0 for a stream or no dataset; ``fleet``: the servers' shared state,
        made in ``ctx`` too, one server at ``initial_version`` when ``None``)."""
        return cls(
            rollout_buffer=ctx.Queue(),
            metrics_queue=ctx.Queue(),
            exception_queue=ctx.Queue(),
            policy_version=ctx.RawValue(ctypes.c_int64, initial_version),
            token_allowance=ctx.RawValue(ctypes.c_int64, initial_allowance),
            consumed_tokens=ctx.RawValue(ctypes.c_int64, 0),
            heartbeat=ctx.RawValue(ctypes.c_double, time.time()),
            failed=ctx.Event(),
            stop=ctx.Event(),
            queued_samples=ctx.RawValue(ctypes.c_int64, 0),
            epoch_size=ctx.RawValue(ctypes.c_int64, epoch_size),
            eval_requests=ctx.Queue(),
            eval_results=ctx.Queue(),
            fleet=fleet if fleet is not None else FleetState.create(ctx, 1, initial_version),
        )

    def queues(self) -> tuple[Queue[Any], ...]:
        """The queues."""
        return self.rollout_buffer, self.metrics_queue, self.exception_queue, self.eval_requests, self.eval_results


def require_channels(channels: WorkerChannels | None) -> WorkerChannels:
    """``channels``, or :class:`RolloutWorkerError` when a loop outside the worker process has none."""
    if channels is None:
        raise RolloutWorkerError("the rollout loop has no channels to the trainer: it runs, and sends groups and "
                                 "metrics, only inside the rollout worker (RolloutWorker); outside it, use evaluate()")
    return channels


async def heartbeat(channels: WorkerChannels) -> None:
    """Beat every ``HEARTBEAT_S`` while the worker's event loop runs (the trainer watches it)."""
    while True:
        channels.heartbeat.value = time.time()
        await asyncio.sleep(HEARTBEAT_S)


async def wait_for_stop(channels: WorkerChannels) -> None:
    """Return when the trainer sets the stop event, or when the trainer process is gone."""
    trainer = mp.parent_process()  # None when the loop runs in the trainer's process (tests)
    while not channels.stop.is_set():
        if trainer is not None and not trainer.is_alive():
            logger.warning("the trainer process is gone (killed?): the rollout worker stops")
            # No one reads the queues any more: exiting must not wait to flush them (their
            # feeder threads block on full pipes).
            for q in channels.queues():
                q.cancel_join_thread()
            return
        await asyncio.sleep(STOP_POLL_S)


def worker_main(loop_cls: type[AsyncRolloutLoop], settings: RolloutSettings, loop_kwargs: dict[str, Any],
                channels: WorkerChannels) -> None:
    """Entry point of the spawned process: build the loop and run it until stopped or failed."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        loop = loop_cls(settings, channels=channels, **loop_kwargs)
        make_eval_loop = functools.partial(evaluation_loop, loop_cls, settings, loop_kwargs, channels)
        asyncio.run(run_with_evaluations(loop, make_eval_loop, channels))
    except BaseException:  # everything, KeyboardInterrupt included, must reach the trainer
        channels.exception_queue.put(traceback.format_exc())
        channels.failed.set()


class RolloutWorker:
    """The trainer's handle on the worker process.

    Args:
        loop_cls: The :class:`~trainer.rollout.loop.AsyncRolloutLoop` (sub)class to run.
        settings: The loop's settings.
        loop_kwargs: Its other constructor arguments: the dataset, reward functions, tokenizer,
            tools, environment factory, resume position, a subclass's own (all must pickle).
        channels: Created with :meth:`WorkerChannels.create` in the same spawn context.
        timeout_s: ``rollout_worker_timeout``: seconds without a heartbeat before the worker counts as hung.
        ctx: The multiprocessing context (:func:`spawn_context`).
    """

    def __init__(self, loop_cls: type[AsyncRolloutLoop], settings: RolloutSettings, loop_kwargs: dict[str, Any],
                 channels: WorkerChannels, timeout_s: float, ctx: SpawnContext) -> None:
        self.channels = channels
        self.timeout_s = timeout_s
        self.process = ctx.Process(target=worker_main, args=(loop_cls, settings, loop_kwargs, channels),
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
            trace = self._traceback()
            # The worker's own stall guards: the trainer raises the same error type as its stall watch.
            error = PipelineStalledError if "PipelineStalledError:" in (trace.strip().splitlines() or [""])[-1] else \
                RolloutWorkerError
            raise error(f"the rollout worker failed:\n{trace}")
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

    def drain_metrics(self) -> list[Record]:
        """Every metric record the worker sent since the last call."""
        records: list[Record] = []
        while True:
            try:
                records.extend(self.channels.metrics_queue.get_nowait())
            except queue.Empty:
                return records

    def _discard_pending(self) -> None:
        for q in (self.channels.rollout_buffer, self.channels.metrics_queue, self.channels.eval_results):
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
        for q in self.channels.queues():
            q.cancel_join_thread()
            q.close()


def spawn_context() -> SpawnContext:
    """The multiprocessing context for the worker (always spawn: no forked CUDA or threads)."""
    return mp.get_context("spawn")
