"""Reward functions that declare ``environments`` get each rollout's environment (TRL GRPOTrainer's signature).

Local environments arrive as the live objects; a remote one as itself for an async function and
wrapped (``SyncEnvironment``: its coroutines run on the loop) for a sync one in a thread. The
scheduler holds each rollout's environment until its group is scored, then returns it to the pool.
"""

from __future__ import annotations

import asyncio
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from environments.counter import IncrementEnv
from sdk import RemoteEnvironment
from tests.envserver.servers import make_server
from trainer.records import Rollout, RolloutGroup
from trainer.rollout.env_pool import EnvironmentPool
from trainer.rollout.scheduler import GroupScheduler
from trainer.rollout.scoring import RewardRunner, SyncEnvironment


def _group(n: int) -> RolloutGroup:
    return RolloutGroup(
        prompts=[[]] * n, reward_kwargs={}, completions=[[{"role": "assistant", "content": "done"}]] * n,
        completions_ids=[[1]] * n, completions_sequences=[[] for _ in range(n)], tool_call_counts=[0] * n,
        tool_failure_counts=[0] * n, policy_version=0, group_id=0, row_index=0, env_rewards=[None] * n,
        rollout_rewards=[None] * n)


def counter_state(completions: list[Any], environments: list[Any], **kwargs: Any) -> list[float]:
    """Scores text and state together: the counter each rollout's environment reached."""
    return [float(env.counter) for env in environments]


async def async_counter_state(completions: list[Any], environments: list[Any], **kwargs: Any) -> list[float]:
    return [float(env.counter) + 0.5 for env in environments]


def text_only(completions: list[Any], **kwargs: Any) -> list[float]:
    assert "environments" not in kwargs  # only the functions that declare it get it
    return [1.0] * len(completions)


def test_local_environments_reach_the_functions_that_declare_them() -> None:
    envs = [IncrementEnv(), IncrementEnv()]
    envs[0].increment(2)
    envs[1].increment(5)
    with ThreadPoolExecutor(2) as executor:
        runner = RewardRunner([counter_state, async_counter_state, text_only], executor, timeout_s=10)
        assert runner.wants_environments
        assert asyncio.run(runner(_group(2), envs)) == [[2.0, 5.0], [2.5, 5.5], [1.0, 1.0]]
        assert not RewardRunner([text_only], executor, timeout_s=10).wants_environments


def remote_reward(completions: list[Any], environments: list[Any], **kwargs: Any) -> list[float]:
    """A sync function in a thread: a remote environment's methods and tools block here."""
    assert all(isinstance(env, SyncEnvironment) for env in environments)
    return [float(env.call("increment", {"step": 0})) + env.get_reward() for env in environments]


async def async_remote_reward(completions: list[Any], environments: list[Any], **kwargs: Any) -> list[float]:
    return [float(await env.increment(step=0)) for env in environments]


def test_remote_environments_are_callable_from_sync_and_async_rewards() -> None:
    server = make_server()
    try:
        async def scenario() -> list[list[float | None]]:
            env = RemoteEnvironment(server.url, "counter")
            await env.reset(target=3)
            await env.call("increment", {"step": 3})
            with ThreadPoolExecutor(2) as executor:
                try:
                    return await RewardRunner([remote_reward, async_remote_reward], executor, 10)(_group(1), [env])
                finally:
                    await env.aclose()

        assert asyncio.run(scenario()) == [[4.0], [3.0]]  # counter 3 + reward 1.0; counter 3
    finally:
        server.stop()


def test_the_scheduler_holds_each_environment_until_its_group_is_scored() -> None:
    pool = EnvironmentPool(IncrementEnv)
    with ThreadPoolExecutor(2) as executor:
        loop = types.SimpleNamespace(envs=pool, rewards=RewardRunner([counter_state], executor, 10))
        scheduler = object.__new__(GroupScheduler)  # only what scoring reads: the loop and the held table
        scheduler.loop, scheduler.held = loop, {}
        rollouts = [Rollout(completion=[], completion_ids=[], turns=[]) for _ in range(2)]
        envs = [pool.acquire(None), pool.acquire(None)]
        envs[1].increment(4)
        scheduler.held = {r.rollout_id: (None, e) for r, e in zip(rollouts, envs, strict=True)}
        assert asyncio.run(scheduler.score_with_environments(_group(2), rollouts)) == [[0.0, 4.0]]
    assert scheduler.held == {}
    assert pool.acquire(None) in envs  # back in the pool once scored
