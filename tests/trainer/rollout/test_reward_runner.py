"""``RewardRunner``: the reward timeout (sync functions in threads, async ones awaited) and typed failures."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from trainer.exceptions import RewardFunctionError, RewardTimeoutError
from trainer.records import RolloutGroup
from trainer.rollout.scoring import RewardRunner


def _group(n: int = 2, hang: bool = False) -> RolloutGroup:
    return RolloutGroup(
        prompts=[[]] * n, reward_kwargs={"hang": [hang] * n}, completions=[[]] * n,
        completions_ids=[[1]] * n, completions_sequences=[[] for _ in range(n)], tool_call_counts=[0] * n,
        tool_failure_counts=[0] * n, policy_version=0, group_id=0, row_index=0, env_rewards=[None] * n,
        rollout_rewards=[None] * n)


release = threading.Event()


def sync_grader(completions, hang, **kwargs):
    if hang[0]:
        release.wait(30)  # a hung parser, released by the test so no thread outlives it
    return [1.0] * len(completions)


async def async_grader(completions, hang, **kwargs):
    if hang[0]:
        await asyncio.sleep(30)
    return [2.0] * len(completions)


def exploding(completions, **kwargs):
    raise KeyError("no such column")


@pytest.fixture()
def executor():
    release.clear()
    pool = ThreadPoolExecutor(4)
    yield pool
    release.set()
    pool.shutdown(wait=True)


def test_a_call_past_the_timeout_scores_nothing_and_is_counted(executor):
    runner = RewardRunner([sync_grader, async_grader], executor, timeout_s=0.3)

    async def scenario():
        t0 = time.monotonic()
        hung = await runner(_group(hang=True))
        elapsed = time.monotonic() - t0
        return hung, elapsed, await runner(_group(hang=False))

    hung, elapsed, fine = asyncio.run(scenario())
    assert hung == [[None, None], [None, None]], "both timed out: neither scores the group"
    assert elapsed < 2.0, f"waited {elapsed:.1f} s for a 0.3 s timeout"
    assert fine == [[1.0, 1.0], [2.0, 2.0]], "the next group is scored normally"
    assert runner.take_timeouts() == {"sync_grader": 1, "async_grader": 1}
    assert runner.take_timeouts() == {}


def test_timeouts_in_a_row_stop_the_run_and_a_success_resets_the_count(executor):
    runner = RewardRunner([sync_grader], executor, timeout_s=0.1, max_timeouts_in_a_row=3)

    async def scenario():
        for hang in (True, True, False, True, True):  # never three in a row
            await runner(_group(hang=hang))
        await runner(_group(hang=True))

    with pytest.raises(RewardTimeoutError, match=r"'sync_grader' ran past reward_timeout=0.1 s in 3 groups in a row"):
        asyncio.run(scenario())


def test_a_raising_or_miscounting_function_is_named(executor):
    with pytest.raises(RewardFunctionError, match=r"reward function 'exploding' raised KeyError: 'no such column'"):
        asyncio.run(RewardRunner([exploding], executor, timeout_s=5)(_group()))
    with pytest.raises(RewardFunctionError, match=r"'short' returned 1 rewards for 2 completions"):
        def short(completions, **kwargs):
            return [0.0]
        asyncio.run(RewardRunner([short], executor, timeout_s=None)(_group()))
