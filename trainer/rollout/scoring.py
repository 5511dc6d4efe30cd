"""Scoring a group: reward sources summed, group-relative advantages, and the drop rule (SPEC §3).

The reward of rollout ``i`` is the sum over its sources (the trainer's reward functions, the
environment's ``get_reward``, ``Rollout.reward``) of the values that are not ``None``; NaN when every
source returned ``None``. Over the scorable set ``S`` of the group::

    A_i = (r_i - mean_S(r)) / (std_S(r) + 1e-4)     (population std; A_i = 0 outside S)

A group with fewer than two scorable rollouts, or whose scorable rewards are all equal, trains
nothing and is dropped (it still counts toward the epoch).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from trainer.records import RolloutGroup

RewardFunc = Callable[..., Any]
STD_EPS = 1e-4


def reward_func_name(func: RewardFunc) -> str:
    """The name a reward function is logged under (``rewards/<name>/mean``)."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def sum_rewards(sources: Sequence[Sequence[float | None]], num_rollouts: int) -> np.ndarray:
    """Per-rollout sum of the non-None values over ``sources``; NaN where all are None."""
    total = np.full(num_rollouts, np.nan)
    for values in sources:
        for i, value in enumerate(values):
            if value is not None:
                total[i] = value if np.isnan(total[i]) else total[i] + value
    return total


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """Group-normalised advantages; 0 for unscorable (NaN) rollouts."""
    scorable = ~np.isnan(rewards)
    advantages = np.zeros_like(rewards, dtype=np.float64)
    if scorable.sum() == 0:
        return advantages
    r = rewards[scorable]
    advantages[scorable] = (r - r.mean()) / (r.std() + STD_EPS)
    return advantages


def is_degenerate(rewards: np.ndarray) -> bool:
    """True when the group trains nothing: < 2 scorable rollouts, or all scorable rewards equal."""
    r = rewards[~np.isnan(rewards)]
    return r.size < 2 or bool(np.all(r == r[0]))


async def call_reward_funcs(
    reward_funcs: Sequence[RewardFunc], group: RolloutGroup, executor: Executor | None = None
) -> list[list[float | None]]:
    """Run every reward function on the group concurrently (async ones awaited, sync ones in threads).

    Each is called with ``prompts``, ``completions``, ``completion_ids`` and the prompt row's other
    columns (one value per rollout). A function that returns the wrong number of rewards raises.
    """
    kwargs: dict[str, Any] = dict(group.reward_kwargs)
    kwargs.update(prompts=group.prompts, completions=group.completions, completion_ids=group.completions_ids)
    loop = asyncio.get_running_loop()

    async def run(func: RewardFunc) -> list[float | None]:
        if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None)):
            values = await func(**kwargs)
        else:
            values = await loop.run_in_executor(executor, functools.partial(func, **kwargs))
        values = list(values)
        if len(values) != len(group.completions):
            raise ValueError(f"reward function {reward_func_name(func)!r} returned {len(values)} rewards "
                             f"for {len(group.completions)} completions")
        return [None if v is None else float(v) for v in values]

    return list(await asyncio.gather(*(run(f) for f in reward_funcs)))
