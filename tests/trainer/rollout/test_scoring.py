"""Scoring a group (docs/loss.md): reward sums, group advantages, the drop rule, calling reward functions."""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from trainer.exceptions import RewardFunctionError
from trainer.records import Rollout, RolloutGroup, TurnRecord
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.scoring import (
    call_reward_funcs,
    group_advantages,
    is_degenerate,
    reward_func_name,
    sum_rewards,
)
from trainer.rollout.settings import RolloutSettings
from trainer.vllm.server_info import ServerInfo

NAN = math.nan


def make_group(n: int = 3, **columns) -> RolloutGroup:
    return RolloutGroup(
        prompts=[[{"role": "user", "content": f"p{i}"}] for i in range(n)],
        reward_kwargs={k: list(v) for k, v in columns.items()},
        completions=[[{"role": "assistant", "content": f"c{i}"}] for i in range(n)],
        completions_ids=[[10 + i, 20 + i] for i in range(n)],
        completions_sequences=[[] for _ in range(n)],
        tool_call_counts=[0] * n, tool_failure_counts=[0] * n,
        policy_version=0, group_id=0, row_index=0,
        env_rewards=[None] * n, rollout_rewards=[None] * n,
    )


# --- sum_rewards ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("sources", "n", "expected"), [
    ([[1.0, 2.0]], 2, [1.0, 2.0]),
    ([[1.0, 2.0], [0.5, -1.0]], 2, [1.5, 1.0]),
    ([[1.0, None], [None, 3.0]], 2, [1.0, 3.0]),          # None contributes nothing
    ([[None, 0.0], [None, None]], 2, [NAN, 0.0]),          # all None -> NaN, but 0.0 is a real score
    ([[None, None, None]], 3, [NAN, NAN, NAN]),
    ([[0.0, 0.0], [0.0, None], [2.0, None]], 2, [2.0, 0.0]),
    ([], 2, [NAN, NAN]),                                   # no sources at all: unscorable
    ([[math.inf, 1.0], [1.0, -math.inf]], 2, [1.0, 1.0]),  # a non-finite value scores like None
    ([[NAN, 1.0]], 2, [NAN, 1.0]),
])
def test_sum_rewards(sources, n, expected):
    np.testing.assert_array_equal(sum_rewards(sources, n), np.array(expected))


# --- group_advantages ----------------------------------------------------------------------------

def reference_advantages(rewards: list[float]) -> list[float]:
    scorable = [r for r in rewards if not math.isnan(r)]
    mean = sum(scorable) / len(scorable)
    std = math.sqrt(sum((r - mean) ** 2 for r in scorable) / len(scorable))  # population std
    return [0.0 if math.isnan(r) else (r - mean) / (std + 1e-4) for r in rewards]


@pytest.mark.parametrize("rewards", [
    [0.0, 1.0],
    [1.0, 0.0, 0.0, 0.0],
    [3.0, -1.0, 2.5, 7.0, 0.0],
    [1.0, NAN, 0.0, NAN],
    [NAN, 5.0, 2.0],
])
def test_group_advantages_formula(rewards):
    np.testing.assert_allclose(group_advantages(np.array(rewards)), reference_advantages(rewards), rtol=1e-12)


def test_group_advantages_uses_population_std():
    # rewards 0/1: population std 0.5 (sample std would be ~0.707), so A = +-0.5 / 0.5001
    adv = group_advantages(np.array([0.0, 1.0]))
    np.testing.assert_allclose(adv, [-0.5 / 0.5001, 0.5 / 0.5001])


def test_group_advantages_zero_for_unscorable_and_all_equal():
    np.testing.assert_array_equal(group_advantages(np.array([NAN, NAN])), [0.0, 0.0])
    np.testing.assert_array_equal(group_advantages(np.array([2.0, 2.0, NAN])), [0.0, 0.0, 0.0])
    # A single scorable rollout: its advantage is 0 (r - mean = 0), the others 0 too.
    np.testing.assert_array_equal(group_advantages(np.array([NAN, 4.0])), [0.0, 0.0])


def test_group_advantages_sum_to_zero_over_scorable():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=16)
    rewards[[2, 5]] = NAN
    adv = group_advantages(rewards)
    assert adv[2] == adv[5] == 0.0
    assert abs(adv.sum()) < 1e-9
    assert not np.isnan(adv).any()


# --- is_degenerate -------------------------------------------------------------------------------

@pytest.mark.parametrize(("rewards", "expected"), [
    ([1.0, 0.0], False),
    ([1.0, 1.0, 1.0], True),                  # all equal
    ([0.0, 0.0, NAN, NAN], True),             # all scorable equal
    ([NAN, 1.0], True),                       # fewer than 2 scorable
    ([NAN, NAN], True),
    ([NAN, 1.0, NAN, 0.5], False),
    ([0.0, 0.0, 0.0, 1e-6], False),
])
def test_is_degenerate(rewards, expected):
    assert is_degenerate(np.array(rewards)) is expected


# --- reward_func_name ----------------------------------------------------------------------------

def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


class Grader:
    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)


@pytest.mark.parametrize(("func", "name"), [
    (length_reward, "length_reward"),
    (functools.partial(length_reward, scale=2), "length_reward"),
    (functools.partial(functools.partial(length_reward, a=1), b=2), "length_reward"),
    (Grader(), "Grader"),
    (functools.partial(Grader(), x=1), "Grader"),
])
def test_reward_func_name(func, name):
    assert reward_func_name(func) == name


# --- call_reward_funcs ---------------------------------------------------------------------------

def test_call_reward_funcs_passes_every_column():
    seen = {}

    def spy(prompts, completions, completion_ids, solution, difficulty, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids,
                    solution=solution, difficulty=difficulty, extra=kwargs)
        return [0.0, 1.0, None]

    group = make_group(3, solution=["a", "b", "c"], difficulty=[1, 2, 3])
    out = asyncio.run(call_reward_funcs([spy], group))
    assert out == [[0.0, 1.0, None]]
    assert seen["prompts"] == group.prompts
    assert seen["completions"] == group.completions
    assert seen["completion_ids"] == group.completions_ids
    assert seen["solution"] == ["a", "b", "c"]
    assert seen["difficulty"] == [1, 2, 3]
    assert seen["extra"] == {}


def test_call_reward_funcs_order_and_float_conversion():
    async def async_ones(completions, **kwargs):
        return [1] * len(completions)

    def ints(completions, **kwargs):
        return np.arange(len(completions))

    out = asyncio.run(call_reward_funcs([ints, async_ones, Grader()], make_group(3)))
    assert out == [[0.0, 1.0, 2.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    assert all(type(v) is float for values in out for v in values)


def sleepy_sync(completions, **kwargs):
    time.sleep(0.3)
    return [1.0] * len(completions)


async def sleepy_async(completions, **kwargs):
    await asyncio.sleep(0.3)
    return [2.0] * len(completions)


class SleepyAsyncGrader:
    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0.3)
        return [3.0] * len(completions)


# Mixed sync / async / callable-instance / partial sources, each result where its function is.
# That they overlap is proven without timing by the barrier and event tests below.
@pytest.mark.parametrize(("funcs", "expected"), [
    ([sleepy_sync] * 3, [[1.0] * 2] * 3),
    ([sleepy_async] * 3, [[2.0] * 2] * 3),
    ([sleepy_sync, sleepy_async, SleepyAsyncGrader()], [[1.0] * 2, [2.0] * 2, [3.0] * 2]),
    ([functools.partial(sleepy_async), functools.partial(sleepy_sync), sleepy_sync], [[2.0] * 2, [1.0] * 2, [1.0] * 2]),
])
def test_call_reward_funcs_mixes_sync_and_async(funcs, expected):
    with ThreadPoolExecutor(max_workers=4) as executor:
        out = asyncio.run(call_reward_funcs(funcs, make_group(2), executor))
    assert out == expected


def test_sync_reward_funcs_overlap_in_threads():
    # Timing-free proof: each function waits for the other at a barrier; run one after the other,
    # the first would wait alone and break it.
    barrier = threading.Barrier(2, timeout=5)

    def meet(completions, **kwargs):
        barrier.wait()
        return [0.0] * len(completions)

    out = asyncio.run(call_reward_funcs([meet, functools.partial(meet)], make_group(2)))
    assert out == [[0.0, 0.0], [0.0, 0.0]]


def test_async_reward_funcs_overlap_on_the_loop():
    async def scenario():
        first_started, second_started = asyncio.Event(), asyncio.Event()

        async def first(completions, **kwargs):
            first_started.set()
            await asyncio.wait_for(second_started.wait(), 5)
            return [1.0] * len(completions)

        async def second(completions, **kwargs):
            second_started.set()
            await asyncio.wait_for(first_started.wait(), 5)
            return [2.0] * len(completions)

        return await call_reward_funcs([first, second], make_group(2))

    assert asyncio.run(scenario()) == [[1.0, 1.0], [2.0, 2.0]]


@pytest.mark.parametrize("returned", [[1.0], [1.0, 2.0, 3.0, 4.0], []])
def test_call_reward_funcs_wrong_count_raises(returned):
    def bad_count(completions, **kwargs):
        return returned

    with pytest.raises(ValueError, match=rf"'bad_count' returned {len(returned)} rewards for 3 completions"):
        asyncio.run(call_reward_funcs([bad_count], make_group(3)))


def test_call_reward_funcs_wrong_count_from_async_raises():
    async def short(completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="'short' returned 1 rewards for 2 completions"):
        asyncio.run(call_reward_funcs([length_reward, short], make_group(2)))


# --- mask_truncated_completions ------------------------------------------------------------------

def _rollout(output_ids: list[int], finish_reason: str) -> Rollout:
    turn = TurnRecord(prompt_ids=[1, 2], output_ids=output_ids, finish_reason=finish_reason)
    return Rollout(completion=[], completion_ids=list(output_ids), turns=[turn])


def test_a_rollout_is_truncated_when_its_last_turn_has_no_eos() -> None:
    eos = [0]
    assert not _rollout([5, 6, 0], "stop").truncated(eos)
    assert _rollout([5, 6, 7], "length").truncated(eos)
    assert _rollout([], "length").truncated(eos)  # no room left for the turn at all
    two_turns = Rollout(completion=[], completion_ids=[5, 0, 7], turns=[
        TurnRecord(prompt_ids=[1], output_ids=[5, 0], finish_reason="stop"),
        TurnRecord(prompt_ids=[1, 5, 0, 9], output_ids=[7], finish_reason="length")])
    assert two_turns.truncated(eos), "only the last turn decides"


def stub_settings(**fields) -> RolloutSettings:
    """Settings of a loop that never reaches a server."""
    fields = {"server": ServerInfo(model="unused", max_model_len=2048), **fields}
    return RolloutSettings(model_name="unused", vllm_server_base_url="http://127.0.0.1:9", **fields)


STUB_TOKENIZER = SimpleNamespace(eos_token_id=0, chat_template=None, get_vocab=dict)
"""Enough of a tokenizer for a loop that scores but never renders (its EOS is token 0)."""


def _scoring_loop(tmp_path, mask: bool) -> AsyncRolloutLoop:
    """A rollout loop that is never started: only its scoring is used (no server, no worker)."""
    return AsyncRolloutLoop(stub_settings(mask_truncated_completions=mask), STUB_TOKENIZER)


@pytest.mark.parametrize("mask", [False, True])
def test_masked_truncated_rollouts_are_scored_but_not_trained(tmp_path, mask: bool) -> None:
    from trainer.records import TrainingSequence

    loop = _scoring_loop(tmp_path, mask)
    group = make_group(4)
    group.rollout_rewards = [1.0, 1.0, 0.0, 0.0]
    group.truncated = [True, False, False, True]
    group.completions_sequences = [[TrainingSequence(input_ids=[1, 10 + i], loss_mask=[0, 1],
                                                     sampler_logprobs=[0.0, -0.5])] for i in range(4)]
    try:
        queued = loop.scheduler.score(group, [], position=3)
    finally:
        loop.executor.shutdown()
    kept = [1, 2] if mask else [0, 1, 2, 3]
    assert [s.sequence.input_ids[1] - 10 for s in queued.samples] == kept
    # Masked rollouts leave the baseline too: the trained advantages sum to zero either way.
    rewards = np.array([NAN, 1.0, 0.0, NAN]) if mask else np.array([1.0, 1.0, 0.0, 0.0])
    expected = group_advantages(rewards)
    assert [s.advantage for s in queued.samples] == pytest.approx(expected[kept])
    assert sum(s.advantage for s in queued.samples) == pytest.approx(0.0, abs=1e-9)
    assert queued.tokens == 2 * len(kept)
    rewards_logged = sorted(value for _, name, value, _ in loop.records.take() if name == "reward")
    assert rewards_logged == [0.0, 0.0, 1.0, 1.0], "the reward metrics see every rollout, truncated or not"


def test_a_group_whose_untruncated_rollouts_all_tie_is_dropped(tmp_path) -> None:
    loop = _scoring_loop(tmp_path, mask=True)
    group = make_group(3)
    group.rollout_rewards = [1.0, 0.0, 0.0]
    group.truncated = [True, False, False]
    try:
        assert loop.scheduler.score(group, [], position=0).samples == []
    finally:
        loop.executor.shutdown()


def test_a_scored_group_carries_its_reward_metrics(tmp_path) -> None:
    """The step that receives a group logs its reward metrics: they travel in the group itself, through
    the one queue, so they cannot trail it into a later window (two queues' feeder threads could).

    ``queue.Queue`` stands in for the multiprocessing queue (the trainer end is not under test).
    """
    import queue

    loop = _scoring_loop(tmp_path, mask=False)
    metrics: queue.Queue = queue.Queue()
    seen_at_put: list[list[str]] = []

    class _Buffer:
        def put(self, item) -> None:
            seen_at_put.append([name for _, name, _, _ in item.records])

    loop.telemetry.channels = SimpleNamespace(metrics_queue=metrics, rollout_buffer=_Buffer(),
                                              queued_samples=SimpleNamespace(value=0))
    group = make_group(2)
    group.rollout_rewards = [1.0, 0.0]
    loop.scheduler.allowance.started()

    async def score_one() -> None:
        await loop.scheduler.score_queue.put((group, [], 0, []))
        task = asyncio.create_task(loop.scheduler.score_forever())
        while not seen_at_put and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()

    try:
        asyncio.run(score_one())
    finally:
        loop.executor.shutdown()
    assert seen_at_put[0].count("reward") == 2 and "rewards/rollout/mean" in seen_at_put[0]


def inf_then_rank(completions, **kwargs):
    return [math.inf] + [float(i) for i in range(1, len(completions))]


def words(completions, **kwargs):
    return ["high"] * len(completions)


def test_a_reward_function_returning_inf_or_nan_does_not_score_that_rollout(caplog):
    out = asyncio.run(call_reward_funcs([inf_then_rank], make_group(3)))
    assert out == [[None, 1.0, 2.0]]
    assert "'inf_then_rank' returned the reward inf, which is not a finite number" in caplog.text
    advantages = group_advantages(sum_rewards(out, 3))
    assert np.isfinite(advantages).all() and advantages[0] == 0.0


def test_a_reward_function_returning_a_non_number_names_itself():
    with pytest.raises(RewardFunctionError, match="reward function 'words' returned 'high', which is not a number"):
        asyncio.run(call_reward_funcs([words], make_group(2)))
