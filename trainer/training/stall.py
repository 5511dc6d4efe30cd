"""No silent stall: the trainer says why nothing reaches it, and stops after ``stall_timeout``.

A pipeline can run and still feed the trainer nothing: every group dropped because its rewards are
all equal (a constant reward, a model that never calls the tools), every reward source returning
``None`` (or ``nan``/``inf``), every rollout failing, every prompt filtered, every sample too stale.
The worker keeps working, so no heartbeat or crash check fires. :class:`StallWatch` counts, on the
trainer's side, what arrived since the last trainable sample and for how long the training loop has
waited for one (time spent training does not count). After ``warn_after_s`` of waiting it reports
(a warning, a row in the progress table, ``pipeline/*`` metrics), again at each further interval,
and at ``stall_timeout`` it raises :class:`~trainer.exceptions.PipelineStalledError` with the same
words. The rollout worker's own guards (every rollout failing, ``filter_prompt`` rejecting a whole
epoch) raise the same error from its side.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.exceptions import PipelineStalledError
from trainer.records import DROP_REASONS, QueuedGroup

__all__ = ["StallReport", "StallWatch"]


@dataclass
class StallReport:
    """What the trainer received since its last trainable sample, and how long it has waited.

    Attributes:
        waited_s: Seconds the training loop has waited (not trained) since the last trainable sample.
        timeout_s: ``stall_timeout``: when the run stops.
        dropped: Groups dropped, by reason (``DROP_REASONS``).
        stale: Samples dropped as older than ``max_staleness`` versions.
        first: No trainable sample has arrived yet in this run.
    """

    waited_s: float
    timeout_s: float
    dropped: Counter[str] = field(default_factory=Counter)
    stale: int = 0
    first: bool = True

    def message(self) -> str:
        """The report in words, with its counts and what to look at."""
        since = "since the run started" if self.first else "since the last one"
        head = f"no trainable sample for {self.waited_s:.0f} s of waiting (stall_timeout={self.timeout_s:g} s)"
        groups = sum(self.dropped.values())
        if not groups and not self.stale:
            return (f"{head}: no group has finished {since}; rollouts are still being generated "
                    "(a slow or unreachable vLLM server, or very long rollouts?)")
        parts = [f"{self.dropped[reason]} {what}" for reason, what in DROP_REASONS.items()]
        return (f"{head}: {groups} groups finished {since}, none trainable: " + ", ".join(parts)
                + f"; {self.stale} samples dropped as stale (older than max_staleness versions)")

    def metrics(self) -> dict[str, float]:
        """The report as ``pipeline/*`` metrics."""
        out = {"pipeline/stalled_s": self.waited_s, "pipeline/stale_dropped_count": float(self.stale)}
        out.update({f"pipeline/dropped_{reason}_count": float(self.dropped[reason]) for reason in DROP_REASONS})
        return out


class StallWatch:
    """Counts what arrives and the time waited since the last trainable sample (module docstring).

    Args:
        timeout_s: ``stall_timeout``: seconds of waiting after which :meth:`waiting` raises.
        report: Called with a :class:`StallReport` at each warning.
        warn_after_s: Seconds of waiting before the first warning, then between warnings.
        clock: The time source (tests pass their own).
    """

    def __init__(self, timeout_s: float, report: Callable[[StallReport], None], warn_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.warn_after_s = warn_after_s if warn_after_s is not None else min(60.0, max(timeout_s / 10, 5.0))
        self._report = report
        self._clock = clock
        self._state = StallReport(0.0, timeout_s)
        self._wait_start: float | None = None
        self._next_warning = self.warn_after_s

    def received(self, group: QueuedGroup) -> None:
        """Count a group off the queue (a dropped one by its reason)."""
        if not group.samples:
            self._state.dropped[group.dropped or "other"] += 1

    def stale(self) -> None:
        """Count a sample dropped as stale."""
        self._state.stale += 1

    def trainable(self) -> None:
        """A sample will train: the count starts again."""
        self._state = StallReport(0.0, self.timeout_s, first=False)
        self._next_warning = self.warn_after_s

    def start_wait(self) -> None:
        """The training loop starts waiting for a sample."""
        self._wait_start = self._clock()

    def stop_wait(self) -> None:
        """The wait ended (a group arrived); its time stays counted until a sample trains."""
        if self._wait_start is not None:
            self._state.waited_s += self._clock() - self._wait_start
            self._wait_start = None

    def waiting(self) -> None:
        """Called while waiting: reports past each interval, raises past ``timeout_s``.

        Raises:
            PipelineStalledError: ``timeout_s`` of waiting without a trainable sample.
        """
        now = self._clock()
        start = self._wait_start if self._wait_start is not None else now
        report = StallReport(self._state.waited_s + now - start, self.timeout_s, Counter(self._state.dropped),
                             self._state.stale, self._state.first)
        if report.waited_s >= self.timeout_s:
            raise PipelineStalledError(report.message() + ". The run stops here; see docs/pipeline.md, 'Stalls'")
        if report.waited_s >= self._next_warning:
            self._next_warning += self.warn_after_s
            self._report(report)
