"""The stall watch: what arrived since the last trainable sample, warnings at each interval of waiting,
and PipelineStalledError at ``stall_timeout`` (a fake clock; the real stack is in tests/trainer/test_stall_run.py)."""

from __future__ import annotations

import pytest

from trainer.exceptions import PipelineStalledError
from trainer.metrics import MetricWindow
from trainer.records import QueuedGroup
from trainer.training.batching import MicroBatchStream
from trainer.training.stall import StallReport, StallWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_waiting_warns_at_each_interval_and_stops_at_the_timeout() -> None:
    clock, reports = Clock(), []
    watch = StallWatch(100.0, reports.append, warn_after_s=10.0, clock=clock)
    watch.start_wait()
    clock.now = 9.0
    watch.waiting()
    assert not reports
    clock.now = 10.5
    watch.waiting()
    assert len(reports) == 1 and "no group has finished since the run started" in reports[0].message()
    for group in [QueuedGroup(0, 0, dropped="zero_spread")] * 3 + [QueuedGroup(1, 1, dropped="unscorable")]:
        watch.received(group)
    watch.stop_wait()
    clock.now = 50.0  # training time between waits does not count
    watch.start_wait()
    clock.now = 61.0
    watch.waiting()
    message = reports[-1].message()
    assert len(reports) == 2 and reports[-1].waited_s == pytest.approx(21.5)
    assert "4 groups finished since the run started, none trainable: 3 for zero reward spread" in message
    assert "1 unscorable" in message and reports[-1].metrics()["pipeline/dropped_zero_spread_count"] == 3
    clock.now = 140.0
    with pytest.raises(PipelineStalledError, match="no trainable sample for 100 s of waiting"):
        watch.waiting()


def test_a_trainable_sample_starts_the_count_again() -> None:
    clock, reports = Clock(), []
    watch = StallWatch(30.0, reports.append, clock=clock)
    assert watch.warn_after_s == 5.0  # a tenth of the timeout, at least 5 s
    watch.start_wait()
    watch.received(QueuedGroup(0, 0, dropped="failed"))
    watch.stale()
    clock.now = 25.0
    watch.waiting()
    watch.stop_wait()
    watch.trainable()
    watch.start_wait()
    clock.now = 50.0
    watch.waiting()  # 25 s since the trainable sample: under the timeout
    assert "since the last one" in reports[-1].message() and reports[-1].stale == 0


def test_the_report_names_every_reason() -> None:
    report = StallReport(12.0, 60.0, first=False)
    report.dropped["filtered"] = 2
    text = report.message()
    assert "2 filtered out by filter_prompt" in text and "0 with every rollout failed" in text


class DroppedForever:
    """A worker whose queue is never empty and never trainable: a dropped group arrives at every call,
    each a second after the last on the watch's clock, so the poll's timeout never fires."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def get(self, timeout_s: float | None = None) -> QueuedGroup:
        self.clock.now += 1.0
        assert self.clock.now < 1000, "the watch never stopped the wait"
        return QueuedGroup(0, 0, dropped="zero_spread")

    def qsize(self) -> int:
        return 1

    def queued_samples(self) -> int:
        return 0

    def epoch_size(self) -> int | None:
        return None

    def add_consumed_tokens(self, tokens: int) -> None:
        pass


def test_a_stream_of_dropped_groups_stops_at_the_timeout_not_later() -> None:
    clock, reports = Clock(), []
    watch = StallWatch(60.0, reports.append, warn_after_s=6.0, clock=clock)
    stream = MicroBatchStream(DroppedForever(clock), num_rows=1, token_budget=64, max_staleness=0,
                              metrics=MetricWindow(), stall=watch)
    with pytest.raises(PipelineStalledError, match=r"no trainable sample for 60 s of waiting"):
        next(stream)
    assert clock.now == 60.0 and len(reports) == 9, "a warning every 6 s, then the stop at 60 s"
