"""The overlapped weight sync (``trainer/sync/background.py``): the training loop goes on while a
sync runs on its thread, waits only until the sync stops reading the weights before changing them,
and gets the sync's error where it waits."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from trainer.exceptions import WeightSyncError
from trainer.sync.background import BackgroundSync
from trainer.sync.weight_sync import SyncTimings


def test_the_caller_waits_for_the_read_and_collects_the_end_later() -> None:
    read, finish = threading.Event(), threading.Event()

    def sync(read_done: Callable[[], None]) -> SyncTimings:
        assert read.wait(30)  # staging the weights
        read_done()
        assert finish.wait(30)  # the server's part
        return SyncTimings(pause_s=0.0, transfer_s=0.5, resume_s=0.0)

    background = BackgroundSync()
    try:
        background.start(sync)
        assert background.pending  # start() returned while the sync runs
        with pytest.raises(RuntimeError, match="already pending"):
            background.start(sync)
        threading.Timer(0.2, read.set).start()
        assert background.wait_for_read() > 0.1  # blocked until the weights were read...
        assert background.collect(block=False) is None  # ...not until the sync ended
        finish.set()
        finished = background.collect()
        assert finished is not None and finished.timings.transfer_s == 0.5 and finished.duration_s > 0.1
        assert not background.pending and background.collect() is None and background.wait_for_read() == 0.0
    finally:
        background.close()


def test_a_sync_that_fails_before_reading_raises_in_the_caller() -> None:
    def sync(read_done: Callable[[], None]) -> SyncTimings:
        raise WeightSyncError("the server refused the update")

    background = BackgroundSync()
    try:
        background.start(sync)
        with pytest.raises(WeightSyncError, match="refused"):
            background.wait_for_read()
        assert not background.pending  # a failed sync is collected with its error
        background.start(lambda read_done: SyncTimings(0.0, 0.1, 0.0))
        assert background.collect() is not None
    finally:
        background.close()


def test_a_sync_that_fails_after_reading_raises_when_collected() -> None:
    read = threading.Event()

    def sync(read_done: Callable[[], None]) -> SyncTimings:
        read_done()
        assert read.wait(30)
        raise WeightSyncError("the engine died mid-load")

    background = BackgroundSync()
    try:
        background.start(sync)
        background.wait_for_read()
        read.set()
        with pytest.raises(WeightSyncError, match="mid-load"):
            background.collect()
    finally:
        background.close()
