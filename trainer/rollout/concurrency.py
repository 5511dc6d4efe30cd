"""The rollout worker's three concurrency limits (``docs/pipeline.md``).

1. **Staleness allowance**: the trainer publishes how many tokens the worker may hold queued or
   in flight (:class:`StalenessAllowance`). TRL AsyncGRPOTrainer's rule (``staleness_allowance="consumed"``):
   ``max(max_staleness, 1)`` x the tokens its last step consumed (before the first step, as if
   every row were full). The default (``"capacity"``) keeps a step of headroom below the drop
   limit and counts what a *full* step takes, not what the last one happened to take:
   ``max(max_staleness - 1, 1)`` x the step's forwarded-token capacity x the packing ratio (sample
   tokens per forwarded token) measured over the last steps (see ``docs/pipeline.md``). In the
   worker (:class:`TokenAllowance`) a new group starts only when its estimated tokens fit; at the
   very start one group runs at a time until the first finishes (nothing is known about group
   sizes yet).
2. **Server load** (:class:`AdaptiveCap`): the cap on rollouts in flight starts at
   KV-cache tokens / ``max_model_len``; every poll of ``/metrics`` (5 s) grows it by 25 % while KV
   use is under 60 % and nothing waits (at most once per cap's worth of finished rollouts), and
   shrinks it by 30 % above 80 % (running requests continue, new ones wait). Without ``/metrics``
   the cap is ``max_concurrent_rollouts``.
3. ``max_concurrent_rollouts`` is the hard ceiling of the cap.

A group starts only when the cap has room for another rollout beyond those already promised to
started groups (:meth:`AdaptiveCap.wait_for_room` / :meth:`AdaptiveCap.reserve`): without that, a
generous allowance would start groups far faster than slots free up, and hundreds of waiting
rollouts would be stamped with an old policy version and woken on every release.

:meth:`AdaptiveCap.take_mean_in_flight` gives the time-weighted mean of the rollouts in flight
since its last call (``rollout/concurrency``): a reading taken at one instant every few seconds
cannot show a stall between two readings.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Literal

from trainer.vllm.prometheus import ServerLoad

GROW_BELOW = 0.60
SHRINK_ABOVE = 0.80
GROW_FACTOR = 1.25
SHRINK_FACTOR = 0.70
PACKING_RATIO_STEPS = 8  # steps over which the packing ratio of the "capacity" rule is measured

AllowanceRule = Literal["consumed", "capacity"]
ALLOWANCE_RULES: tuple[AllowanceRule, ...] = ("consumed", "capacity")


class AdaptiveCap:
    """How many rollouts may be in flight; an asyncio gate that follows the server's load.

    Args:
        ceiling: ``max_concurrent_rollouts``.
        kv_cache_tokens: The server's KV-cache capacity; ``None`` when ``/metrics`` is unavailable.
        max_model_len: The server's longest sequence.
        clock: Seconds, monotonic (for :meth:`take_mean_in_flight`).
    """

    def __init__(self, ceiling: int, kv_cache_tokens: int | None, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ceiling = ceiling
        self.adaptive = kv_cache_tokens is not None
        start = kv_cache_tokens // max(max_model_len, 1) if kv_cache_tokens else ceiling
        self.cap = float(min(max(start, 1), ceiling))
        self.in_flight = 0
        self.reserved = 0  # rollouts of started groups that have not taken a slot yet
        self.finished = 0
        self._finished_at_last_growth = 0
        self._changed = asyncio.Condition()
        self._clock = clock
        self._mark = self._window_start = clock()
        self._in_flight_area = 0.0  # integral of in_flight over time since _window_start

    @property
    def limit(self) -> int:
        """The cap as a whole number of rollouts."""
        return max(1, int(self.cap))

    def reserve(self, rollouts: int) -> None:
        """Promise ``rollouts`` slots to a group that is starting (each taken by ``acquire(reserved=True)``)."""
        self.reserved += rollouts

    async def wait_for_room(self) -> None:
        """Wait until a slot is free beyond those promised to started groups."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight + self.reserved < self.limit)

    async def acquire(self, reserved: bool = False) -> None:
        """Wait for a free slot and take it; ``reserved`` when the slot was promised by :meth:`reserve`."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight < self.limit)
            self._integrate()
            self.in_flight += 1
            if reserved:
                self.reserved -= 1

    async def release(self) -> None:
        """Give a slot back (a rollout finished)."""
        async with self._changed:
            self._integrate()
            self.in_flight -= 1
            self.finished += 1
            self._changed.notify_all()

    def take_mean_in_flight(self) -> float:
        """Time-weighted mean of the rollouts in flight since the previous call (or the start)."""
        self._integrate()
        span = self._mark - self._window_start
        mean = self._in_flight_area / span if span > 0 else float(self.in_flight)
        self._window_start, self._in_flight_area = self._mark, 0.0
        return mean

    def _integrate(self) -> None:
        now = self._clock()
        self._in_flight_area += self.in_flight * (now - self._mark)
        self._mark = now

    async def set_cap(self, cap: float) -> None:
        """Set the cap from outside (the gate over several servers: the sum of their caps)."""
        async with self._changed:
            self.cap = float(min(max(cap, 1.0), self.ceiling))
            self._changed.notify_all()

    async def observe(self, load: ServerLoad | None) -> None:
        """Adjust the cap to one ``/metrics`` reading."""
        if not self.adaptive or load is None:
            return
        async with self._changed:
            if load.kv_cache_usage > SHRINK_ABOVE:
                self.cap = max(1.0, self.cap * SHRINK_FACTOR)
            elif (load.kv_cache_usage < GROW_BELOW and load.waiting == 0
                  and self.finished - self._finished_at_last_growth >= self.limit):
                self.cap = min(float(self.ceiling), self.cap * GROW_FACTOR)
                self._finished_at_last_growth = self.finished
            self._changed.notify_all()


class TokenAllowance:
    """Decides whether another group may start, from the trainer's token allowance.

    ``allowance`` and ``consumed`` are read from values the trainer writes (shared memory);
    ``produced`` counts the tokens this worker queued. A group in flight is counted at the mean
    size of the groups finished so far.
    """

    def __init__(self) -> None:
        self.produced = 0
        self.groups_in_flight = 0
        self._finished_groups = 0
        self._finished_tokens = 0

    @property
    def mean_group_tokens(self) -> float | None:
        """Mean forwarded tokens of a finished group, ``None`` before the first one."""
        return self._finished_tokens / self._finished_groups if self._finished_groups else None

    def may_start(self, allowance: int, consumed: int) -> bool:
        """Whether one more group fits in ``allowance`` given what the trainer ``consumed``."""
        estimate = self.mean_group_tokens
        if estimate is None:  # nothing known yet: one group at a time until the first finishes
            return self.groups_in_flight == 0
        queued = max(self.produced - consumed, 0)
        if queued == 0 and self.groups_in_flight == 0:
            return True  # never starve the trainer, whatever the allowance says
        return queued + (self.groups_in_flight + 1) * estimate <= allowance

    def started(self) -> None:
        """A group started."""
        self.groups_in_flight += 1

    def finished(self, tokens_queued: int, tokens_generated_total: int) -> None:
        """A group finished: ``tokens_queued`` went to the queue (0 when it was dropped)."""
        self.groups_in_flight -= 1
        self.produced += tokens_queued
        self._finished_groups += 1
        self._finished_tokens += tokens_generated_total


class StalenessAllowance:
    """The trainer's side of limit (1): how many sample tokens the worker may hold queued or in flight.

    Args:
        rule: ``"consumed"`` (TRL AsyncGRPOTrainer's: ``max(max_staleness, 1)`` x the tokens the last step
            consumed) or ``"capacity"`` (``max(max_staleness - 1, 1)`` x what a full step takes).
        max_staleness: The drop limit, in policy versions.
        step_capacity: Forwarded tokens one step can take (token budget x rows x micro-batches).

    Under ``"consumed"`` a worker faster than the trainer fills ``max_staleness`` steps of queue, so
    every sample is trained right at the drop limit and any jitter (a step that packs fewer
    samples, a group in flight across a sync) drops it. A step that took little because little
    was queued also shrinks the next allowance, although a longer queue would have been taken.
    ``"capacity"`` measures a step in what it can take (its forwarded-token capacity times the
    sample tokens packed per forwarded token) and keeps one step of lag in hand.
    """

    def __init__(self, rule: AllowanceRule, max_staleness: int, step_capacity: int) -> None:
        if rule not in ALLOWANCE_RULES:
            raise ValueError(f"staleness allowance rule {rule!r} is not one of {ALLOWANCE_RULES}")
        self.rule = rule
        self.step_capacity = step_capacity
        self.steps_ahead = max(max_staleness, 1) if rule == "consumed" else max(max_staleness - 1, 1)
        self._packing: collections.deque[tuple[int, int]] = collections.deque(maxlen=PACKING_RATIO_STEPS)

    @property
    def initial(self) -> int:
        """The allowance before the first step: every row full, one sample token per forwarded token."""
        return self.steps_ahead * self.step_capacity

    @property
    def packing_ratio(self) -> float:
        """Sample tokens packed per forwarded token over the last steps (1 before any)."""
        packed = sum(p for p, _ in self._packing)
        forwarded = sum(f for _, f in self._packing)
        return packed / forwarded if forwarded else 1.0

    def after_step(self, consumed: int, packed: int, forwarded: int) -> int:
        """The allowance after a step that took ``consumed`` sample tokens off the queue and packed
        ``packed`` of them into ``forwarded`` forwarded tokens."""
        if self.rule == "consumed":
            return self.steps_ahead * consumed
        if forwarded > 0:
            self._packing.append((packed, forwarded))
        return max(int(self.steps_ahead * self.step_capacity * self.packing_ratio), 1)
