"""From the rollout queue to micro-batches: stale drop, epoch progress, row planning.

The training loop pulls micro-batches from a :class:`MicroBatchStream`. Each one takes scored
groups off the worker's queue, drops samples older than ``max_staleness`` policy versions, and
fills one row per process with the :class:`~trainer.training.packing.RowPlanner` until the planner closes
the micro-batch, or the queue is empty and the micro-batch already holds something (a step only
waits when there is nothing to train on).

Progress is counted in prompts: a prompt is *done* when its group was dropped by the worker or
when its last sample was taken for training (or dropped as stale). ``first_untrained`` (the
smallest position not done) is what a checkpoint records, with the positions past it that are done
or partly trained (groups finish out of order): a resume generates neither again, so no prompt is
trained twice and none is lost. The epoch count is prompts done / dataset size.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trainer.metrics import MetricWindow
from trainer.records import GroupSource, QueuedGroup, TrainingSample
from trainer.training.packing import (
    OversizeSampleError,
    PackedRow,
    RowPlanner,
    batch_metrics,
)
from trainer.training.stall import StallWatch

logger = logging.getLogger(__name__)
STALL_POLL_S = 1.0  # how often a blocked wait lets the stall watch look
UNPACKED_PER_STEP = "batch/unpacked_tokens_per_step"  # sample tokens packed into the step's rows
FORWARDED_PER_STEP = "batch/forwarded_tokens_per_step"


@dataclass
class MicroBatch:
    """One micro-batch: a row per process, and what the loss normalisation needs."""

    rows: list[PackedRow]
    num_trained_global: int
    num_samples: int
    forwarded_tokens: int
    unpacked_tokens: int

    def row_for(self, process_index: int) -> PackedRow:
        """The row this process forwards."""
        return self.rows[process_index]


@dataclass
class _Progress:
    """Which prompt positions are done, and the first one that is not."""

    first_untrained: int
    done: set[int] = field(default_factory=set)
    remaining: dict[int, int] = field(default_factory=dict)  # position -> samples not yet taken
    started: set[int] = field(default_factory=set)  # positions with some samples taken, not all

    def finish(self, position: int) -> None:
        self.started.discard(position)
        self.done.add(position)
        while self.first_untrained in self.done:
            self.done.remove(self.first_untrained)
            self.first_untrained += 1


class MicroBatchStream:
    """Iterator of :class:`MicroBatch` fed by the rollout worker.

    Args:
        worker: The worker handle (its queue and health checks).
        num_rows: Rows per micro-batch (the number of processes).
        token_budget: Cap on a row's unique tokens.
        max_staleness: Samples more than this many versions behind the policy are dropped.
        metrics: The trainer's metric window (stale drops, queue sizes, waits...).
        start_position: First untrained prompt position (from a checkpoint when resuming).
        done_positions: Positions past ``start_position`` the checkpoint counts as trained (the
            worker skips them too).
        stop_position: Prompt positions at or past this are not trained (the epoch limit); ``None``
            for no limit (or, with ``stop_epochs``, until the worker knows the epoch size).
        stop_epochs: For a stream: ``stop_position`` becomes ``stop_epochs`` x its epoch size once
            the worker reports that size, before any prompt of its second pass arrives.
        keep_samples: Keep the trained samples until :meth:`take_trained_samples` (``log_completions``).
        share_prefixes: Tree packing (``True``); ``False`` for rows that share nothing (``packing="per_sample"``).
        stall: Watches the waits for a trainable sample (:mod:`trainer.training.stall`); ``None``: wait forever.
    """

    def __init__(self, worker: GroupSource, num_rows: int, token_budget: int, max_staleness: int,
                 metrics: MetricWindow, start_position: int = 0, stop_position: int | None = None,
                 keep_samples: bool = False, done_positions: Iterable[int] = (),
                 stop_epochs: float | None = None, share_prefixes: bool = True,
                 stall: StallWatch | None = None) -> None:
        self.worker = worker
        self.stall = stall
        self.planner = RowPlanner(num_rows, token_budget, share_prefixes)
        self.token_budget = token_budget
        self.max_staleness = max_staleness
        self.metrics = metrics
        self.policy_version = 0
        self.stop_position = stop_position
        self.stop_epochs = stop_epochs
        self.progress = _Progress(first_untrained=start_position,
                                  done={p for p in done_positions if p > start_position})
        self._buffer: collections.deque[tuple[int, TrainingSample]] = collections.deque()
        self._held_over: tuple[int, TrainingSample] | None = None
        self.tokens_consumed = 0  # forwarded tokens taken off the queue since the last reset
        self._samples_received = 0  # samples taken off the worker's queue
        self.wait_s = 0.0
        self._step_totals: dict[str, float] = {}
        self.keep_samples = keep_samples
        self._trained: list[TrainingSample] = []

    def __iter__(self) -> MicroBatchStream:
        return self

    @property
    def epoch_done(self) -> bool:
        """Whether every prompt before ``stop_position`` is done."""
        return self.stop_position is not None and self.progress.first_untrained >= self.stop_position

    def _receive(self, group: QueuedGroup) -> None:
        self.metrics.add_records(group.records)  # logged by the step that receives the group
        self.worker.add_consumed_tokens(group.tokens)
        self.tokens_consumed += group.tokens
        self._samples_received += len(group.samples)
        if self.stop_position is None and self.stop_epochs is not None and self.worker.epoch_size():
            self.stop_position = int(round(self.stop_epochs * (self.worker.epoch_size() or 0)))
        beyond = self.stop_position is not None and group.position >= self.stop_position
        if not group.samples or beyond:
            self.progress.finish(group.position)
            return
        self.progress.remaining[group.position] = len(group.samples)
        self.metrics.add("sample/received_count", len(group.samples))
        self._buffer.extend((group.position, s) for s in group.samples)

    def _taken(self, position: int) -> None:
        left = self.progress.remaining[position] - 1
        if left:
            self.progress.remaining[position] = left
            self.progress.started.add(position)
        else:
            del self.progress.remaining[position]
            self.progress.finish(position)

    def _next_sample(self, block: bool) -> tuple[int, TrainingSample] | None:
        """The next sample fresh enough to train on (stale ones are dropped and counted)."""
        while True:
            if self._held_over is not None:
                (position, sample), self._held_over = self._held_over, None
            else:
                while not self._buffer:
                    group = self._wait_for_group() if block else self.worker.get(timeout_s=0.0)
                    if group is None:
                        return None
                    self._receive(group)
                    if self.stall is not None:
                        self.stall.received(group)
                        if block:  # dropped groups may arrive faster than the poll: the wait is checked here too
                            self.stall.waiting()
                position, sample = self._buffer.popleft()
            if self.policy_version - sample.policy_version <= self.max_staleness:
                if self.stall is not None:
                    self.stall.trainable()
                return position, sample
            self.metrics.add("sample/dropped_stale_count", 1)
            if self.stall is not None:
                self.stall.stale()
                if block:
                    self.stall.waiting()
            self._taken(position)

    def _wait_for_group(self) -> QueuedGroup:
        """Block until a group arrives, letting the stall watch report (and stop the run) meanwhile."""
        t0 = time.monotonic()
        if self.stall is not None:
            self.stall.start_wait()
        try:
            while True:
                group = self.worker.get(timeout_s=STALL_POLL_S if self.stall is not None else None)
                if group is not None:
                    return group
                assert self.stall is not None  # without one, get() waits until a group arrives
                self.stall.waiting()
        finally:
            if self.stall is not None:
                self.stall.stop_wait()
            self.wait_s += time.monotonic() - t0

    def __next__(self) -> MicroBatch:
        self.metrics.add("rollout/queue_size", self.queued_samples())
        placed = 0
        while True:
            item = self._next_sample(block=placed == 0)
            if item is None:
                break
            position, sample = item
            try:
                ok = self.planner.add(sample)
            except OversizeSampleError:
                logger.warning("dropping a sample of %d tokens: larger than token_budget=%d",
                               sample.num_tokens, self.token_budget)
                self.metrics.add("batch/dropped_oversize_count", 1)
                self._taken(position)
                continue
            if not ok:
                self._held_over = item
                break
            placed += 1
            self._taken(position)
            self.metrics.add("sample/time_in_queue_s", time.time() - sample.queued_at)
            self.metrics.add("sample/staleness_mean", self.policy_version - sample.policy_version)
            self.metrics.add("sample/staleness_max", self.policy_version - sample.policy_version)
            self.metrics.add("reward_trained", sample.reward)
            self.metrics.add("reward_group_std", sample.reward_group_std)
            for name, std in sample.reward_func_group_stds.items():
                self.metrics.add(f"rewards/{name}/group_std", std)
            if self.keep_samples:
                self._trained.append(sample)
        rows = self.planner.rows()
        unpacked = sum(r.num_unpacked_tokens for r in rows)
        # The staleness allowance's packing ratio (trainer.rollout.concurrency.StalenessAllowance).
        self._step_totals[UNPACKED_PER_STEP] = self._step_totals.get(UNPACKED_PER_STEP, 0.0) + unpacked
        for name, value in batch_metrics(rows, self.token_budget).items():
            if name.endswith("_per_step"):  # summed over the step's micro-batches, recorded per step
                self._step_totals[name] = self._step_totals.get(name, 0.0) + value
            else:
                self.metrics.add(name, value)
        return MicroBatch(
            rows=rows,
            num_trained_global=sum(r.num_trained for r in rows),
            num_samples=placed,
            forwarded_tokens=sum(r.num_unique_tokens for r in rows),
            unpacked_tokens=unpacked,
        )

    def queued_samples(self) -> int:
        """Scored samples waiting to train: still on the worker's queue, or taken off it but not yet placed."""
        on_queue = max(self.worker.queued_samples() - self._samples_received, 0)
        return on_queue + len(self._buffer) + (self._held_over is not None)

    def take_step_stats(self) -> tuple[int, float, dict[str, float]]:
        """(tokens taken off the queue, seconds spent waiting, ``batch/*_per_step`` totals) since
        the last call: call once per optimizer step."""
        out = (self.tokens_consumed, self.wait_s, self._step_totals)
        self.tokens_consumed, self.wait_s, self._step_totals = 0, 0.0, {}
        return out

    def take_trained_samples(self) -> list[TrainingSample]:
        """The samples placed since the last call (empty unless ``keep_samples``)."""
        out, self._trained = self._trained, []
        return out

    def state(self) -> dict[str, Any]:
        """What a checkpoint records about the stream (``done_positions``: past the first untrained
        one, those done or partly trained, which a resume must not generate again)."""
        return {"first_untrained_position": self.progress.first_untrained, "policy_version": self.policy_version,
                "done_positions": sorted(self.progress.done | self.progress.started)}
