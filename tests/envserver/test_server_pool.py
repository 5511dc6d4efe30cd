"""The batched thread pool: results and errors come back, a slow job never delays the next one."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from envserver.pool import InlinePolicy, SyncPool


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
        slow = asyncio.ensure_future(pool.run(nap, seconds=5.0))
        await asyncio.sleep(0.05)
        for _ in range(20):
            await pool.run(nap, seconds=0)
        fast_done_first = not slow.done()  # ordering, not timing: the 20 jobs ran while it slept
        await slow
        return fast_done_first

    try:
        assert asyncio.run(scenario())
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


def cheap() -> int:
    return 1


def test_policy_inlines_after_enough_fast_runs_and_demotes_on_a_slow_inline_run():
    policy = InlinePolicy(threshold=0.01, promote_after=3)
    for _ in range(2):
        policy.record(cheap, 0.0001, inline=False)
    assert not policy.inline(cheap)
    policy.record(cheap, 0.0001, inline=False)
    assert policy.inline(cheap)
    policy.record(cheap, 0.5, inline=True)  # ran long on the loop: back to the pool
    assert not policy.inline(cheap)
    for _ in range(5):
        policy.record(cheap, 0.0001, inline=False)
    assert not policy.inline(cheap)  # now it needs twice as many fast runs in a row
    policy.record(cheap, 0.0001, inline=False)
    assert policy.inline(cheap)


def test_policy_restarts_the_count_after_a_slow_run_in_the_pool():
    policy = InlinePolicy(threshold=0.01, promote_after=3)
    for seconds in (0.0001, 0.0001, 0.5, 0.0001, 0.0001):
        policy.record(cheap, seconds, inline=False)
    assert not policy.inline(cheap)
    policy.record(cheap, 0.0001, inline=False)
    assert policy.inline(cheap)


def test_policy_knows_a_method_by_its_function_across_instances():
    class Env:
        def step(self) -> int:
            return 1

    policy = InlinePolicy(threshold=0.01, promote_after=2)
    policy.record(Env().step, 0.0001, inline=False)
    policy.record(Env().step, 0.0001, inline=False)
    assert policy.inline(Env().step)


@pytest.mark.parametrize(("threshold", "promote_after"), [(0.0, 16), (-1.0, 16), (0.001, 0)])
def test_policy_refuses_bad_settings(threshold, promote_after):
    with pytest.raises(ValueError, match="threshold > 0 and promote_after >= 1"):
        InlinePolicy(threshold, promote_after)


def test_pool_runs_a_cheap_callable_on_the_loop_once_it_proved_fast():
    pool = SyncPool(workers=2, policy=InlinePolicy(threshold=1.0, promote_after=3))

    def where() -> str:
        return threading.current_thread().name

    async def scenario():
        return [await pool.run(where) for _ in range(6)]

    try:
        names = asyncio.run(scenario())
        loop_thread = threading.current_thread().name
        assert loop_thread not in names[:3]  # the first runs prove it in the pool
        assert names[-1] == loop_thread  # then it runs inline
    finally:
        pool.shutdown()
