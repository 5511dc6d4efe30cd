"""The batched thread pool: results and errors come back, a slow job never delays the next one."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from envserver.pool import SyncPool


def nap(seconds: float) -> None:
    time.sleep(seconds)


def test_results_errors_and_worker_threads():
    pool = SyncPool(workers=4)

    def where(value: int) -> tuple[int, str]:
        return value * 2, threading.current_thread().name

    def boom() -> None:
        raise KeyError("missing")

    async def scenario():
        results = await asyncio.gather(*(pool.run(where, value=v) for v in range(50)))
        with pytest.raises(KeyError, match="missing"):
            await pool.run(boom)
        return results

    try:
        results = asyncio.run(scenario())
        assert [r[0] for r in results] == [v * 2 for v in range(50)]
        assert {r[1] for r in results} <= {f"toolgym-env-{i}" for i in range(4)}
    finally:
        pool.shutdown()


def test_a_slow_job_does_not_delay_the_jobs_behind_it():
    pool = SyncPool(workers=8)

    async def scenario():
        slow = asyncio.ensure_future(pool.run(nap, seconds=1.0))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        for _ in range(20):
            await pool.run(nap, seconds=0)
        fast_elapsed = time.monotonic() - started
        await slow
        return fast_elapsed

    try:
        assert asyncio.run(scenario()) < 0.5
    finally:
        pool.shutdown()


def test_a_job_cancelled_by_a_deadline_still_finishes_on_its_thread():
    pool = SyncPool(workers=2)

    async def scenario():
        job = pool.submit(nap, seconds=0.3)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(job.future, 0.05)
        finished_at_timeout = job.finished
        await asyncio.sleep(0.5)
        return finished_at_timeout, job.finished

    try:
        assert asyncio.run(scenario()) == (False, True)
    finally:
        pool.shutdown()
