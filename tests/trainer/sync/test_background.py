"""The overlapped weight sync (``trainer/sync/background.py``): the training loop goes on while a
sync runs on its thread, waits for it only when asked, and gets its error there."""

from __future__ import annotations

import threading

import pytest

from trainer.exceptions import WeightSyncError
from trainer.sync.background import BackgroundSync
from trainer.sync.weight_sync import SyncTimings


def test_the_caller_goes_on_while_the_sync_runs_and_waits_only_for_what_is_left() -> None:
    release, started = threading.Event(), threading.Event()

    def sync() -> SyncTimings:
        started.set()
        assert release.wait(30)
        return SyncTimings(pause_s=0.0, transfer_s=0.5, resume_s=0.0)

    background = BackgroundSync()
    try:
        background.start(sync)
        assert started.wait(30) and background.pending  # start() returned while the sync is still running
        with pytest.raises(RuntimeError, match="already pending"):
            background.start(sync)
        threading.Timer(0.2, release.set).start()
        finished = background.wait()
        assert finished is not None and finished.timings.transfer_s == 0.5
        assert finished.waited_s > 0.1 and finished.duration_s >= finished.waited_s
        assert not background.pending and background.wait() is None
    finally:
        background.close()


def test_a_failed_sync_raises_in_the_caller_at_wait() -> None:
    def sync() -> SyncTimings:
        raise WeightSyncError("the server refused the update")

    background = BackgroundSync()
    try:
        background.start(sync)
        with pytest.raises(WeightSyncError, match="refused"):
            background.wait()
        background.start(lambda: SyncTimings(0.0, 0.1, 0.0))  # a failed sync is no longer pending
        assert background.wait() is not None
    finally:
        background.close()
