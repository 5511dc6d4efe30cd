"""Scoring a group: reward sources summed, group-relative advantages, and the drop rule.

The reward of rollout ``i`` is the sum over its sources (the trainer's reward functions, the
environment's ``get_reward``, ``Rollout.reward``) of the values that are not ``None``; NaN when every
source returned ``None``. A value that is not a finite number (``inf``, ``nan``) counts as ``None``:
one ``inf`` would otherwise make every advantage of its group ``nan`` and the step's gradients with
them (:func:`finite_reward`). Over the scorable set ``S`` of the group::

    A_i = (r_i - mean_S(r)) / (std_S(r) + 1e-4)     (population std; A_i = 0 outside S)

A group with fewer than two scorable rollouts, or whose scorable rewards are all equal, trains
nothing and is dropped (it still counts toward the epoch).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from trainer.exceptions import RewardFunctionError, RewardTimeoutError
from trainer.records import RolloutGroup

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., Any]
STD_EPS = 1e-4


def reward_func_name(func: RewardFunc) -> str:
    """The name a reward function is logged under (``rewards/<name>/mean``)."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def finite_reward(value: Any, source: str) -> float | None:
    """``value`` as a float, or ``None`` (unscorable by this source) when it is ``None`` or not finite.

    A non-finite reward is a bug in what produced it, not a score: it is warned about, naming it, and
    the rollout is scored by its other sources only.
    """
    if value is None:
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise RewardFunctionError(f"{source} returned {value!r:.100}, which is not a number or None") from None
    if math.isfinite(reward):
        return reward
    logger.warning("%s returned the reward %r, which is not a finite number: that rollout is not scored by it",
                   source, reward)
    return None


def sum_rewards(sources: Sequence[Sequence[float | None]], num_rollouts: int) -> np.ndarray:
    """Per-rollout sum of the finite values over ``sources``; NaN where none is (the rollout is unscorable)."""
    total = np.full(num_rollouts, np.nan)
    for values in sources:
        for i, value in enumerate(values):
            if value is not None and math.isfinite(value):
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


class RewardRunner:
    """Runs the reward functions on each group, each call bounded by ``timeout_s``.

    Async functions are awaited and cancelled at the deadline; sync ones (``accuracy_reward``'s
    math-verify parsing included) run on ``executor``'s threads, which cannot be stopped, so a call
    past its deadline is abandoned: its thread finishes (or not) on its own. A function that times
    out gives ``None`` for the group (not scored by it, ``rewards/<name>/timeout_count``) and the run
    goes on; one that times out in ``max_timeouts_in_a_row`` groups in a row hangs on every input,
    so the run stops with :class:`~trainer.exceptions.RewardTimeoutError`. A function that raises, or
    returns the wrong number of rewards, stops the run with
    :class:`~trainer.exceptions.RewardFunctionError` naming it.

    Args:
        reward_funcs: The reward functions.
        executor: Thread pool for the sync ones.
        timeout_s: ``reward_timeout``: seconds one call may take; ``None`` for no limit.
        max_timeouts_in_a_row: Consecutive timed-out groups of one function before the run stops.
    """

    def __init__(self, reward_funcs: Sequence[RewardFunc], executor: Executor | None, timeout_s: float | None,
                 max_timeouts_in_a_row: int = 3) -> None:
        self.reward_funcs = list(reward_funcs)
        self.executor = executor
        self.timeout_s = timeout_s
        self.max_timeouts_in_a_row = max_timeouts_in_a_row
        self._timeouts_in_a_row = [0] * len(self.reward_funcs)
        self.timeout_counts: dict[str, int] = {}  # per function name, since the last take_timeouts()
        self._sees_environments = [declares_environments(f) for f in self.reward_funcs]

    @property
    def wants_environments(self) -> bool:
        """Whether a reward function declares ``environments``: each rollout's environment is then held
        until its group is scored, instead of going back to the pool when the episode ends."""
        return any(self._sees_environments)

    async def __call__(self, group: RolloutGroup,
                       environments: Sequence[Any] | None = None) -> list[list[float | None]]:
        """One list of rewards per function (``None`` where it does not apply or timed out).

        Args:
            group: The group's prompts, completions and columns.
            environments: Each rollout's environment, passed as ``environments`` to the functions that
                declare it: the live object when local; a remote one (async) wrapped for a sync function
                in a thread so that its tools and methods block (:class:`SyncEnvironment`).
        """
        kwargs: dict[str, Any] = dict(group.reward_kwargs)
        kwargs.update(prompts=group.prompts, completions=group.completions, completion_ids=group.completions_ids)
        n = len(group.completions)
        envs = list(environments) if environments is not None else [None] * n
        return list(await asyncio.gather(*(
            self._run(i, f, {**kwargs, "environments": _seen_by(f, envs)} if self._sees_environments[i] else kwargs, n)
            for i, f in enumerate(self.reward_funcs))))

    def take_timeouts(self) -> dict[str, int]:
        """Timed-out calls per function name since the last call."""
        out, self.timeout_counts = self.timeout_counts, {}
        return out

    async def _run(self, index: int, func: RewardFunc, kwargs: dict[str, Any], n: int) -> list[float | None]:
        name = reward_func_name(func)
        if _is_async(func):
            call = func(**kwargs)
        else:
            call = asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(func, **kwargs))
        try:
            values = list(await asyncio.wait_for(call, self.timeout_s))
        except TimeoutError:
            return self._timed_out(index, name, n)
        except Exception as exc:
            raise RewardFunctionError(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
        self._timeouts_in_a_row[index] = 0
        if len(values) != n:
            raise RewardFunctionError(f"reward function {name!r} returned {len(values)} rewards for {n} completions")
        return [finite_reward(v, f"reward function {name!r}") for v in values]

    def _timed_out(self, index: int, name: str, n: int) -> list[float | None]:
        self._timeouts_in_a_row[index] += 1
        self.timeout_counts[name] = self.timeout_counts.get(name, 0) + 1
        if self._timeouts_in_a_row[index] >= self.max_timeouts_in_a_row:
            raise RewardTimeoutError(
                f"reward function {name!r} ran past reward_timeout={self.timeout_s:g} s in "
                f"{self._timeouts_in_a_row[index]} groups in a row: it hangs (the calls still hold their "
                "threads); fix it or raise reward_timeout")
        logger.warning("reward function %r ran past reward_timeout=%g s; this group is not scored by it",
                       name, self.timeout_s)
        return [None] * n


def declares_environments(func: RewardFunc) -> bool:
    """Whether ``func`` takes a parameter named ``environments`` (as TRL's GRPOTrainer passes them)."""
    try:
        return "environments" in inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _is_async(func: RewardFunc) -> bool:
    # An object with an async __call__ (not a callability test: B004 does not apply).
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))  # noqa: B004


def _seen_by(func: RewardFunc, envs: list[Any]) -> list[Any]:
    """The environments as ``func`` gets them: as they are for an async function (it awaits a remote
    one's methods), remote ones wrapped in a :class:`SyncEnvironment` for a sync one (run in a thread)."""
    if _is_async(func):
        return envs
    loop = asyncio.get_running_loop()
    return [SyncEnvironment(env, loop) if _is_remote(env) else env for env in envs]


def _is_remote(env: Any) -> bool:
    """A remote environment: its ``reset`` is a coroutine (``RemoteEnvironment``, ``OpenEnvEnvironment``...)."""
    return env is not None and inspect.iscoroutinefunction(getattr(env, "reset", None))


class SyncEnvironment:
    """A remote (async) environment as a sync reward function running in a thread sees it.

    Every method and tool of the environment is a blocking call here: the coroutine runs on the
    rollout worker's event loop (``env.state()``, ``env.call("increment", {...})``, a remote
    ``env.increment(step=1)``); anything else is the environment's attribute itself.
    """

    def __init__(self, env: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._env = env
        self._loop = loop

    def __repr__(self) -> str:
        return f"SyncEnvironment({self._env!r})"

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._env, name)
        if not callable(value):
            return value

        def blocking(*args: Any, **kwargs: Any) -> Any:
            result = value(*args, **kwargs)
            if inspect.isawaitable(result):
                return asyncio.run_coroutine_threadsafe(_awaited(result), self._loop).result()
            return result

        return blocking


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


async def call_reward_funcs(reward_funcs: Sequence[RewardFunc], group: RolloutGroup, executor: Executor | None = None,
                            timeout_s: float | None = None) -> list[list[float | None]]:
    """Run every reward function on the group once (see :class:`RewardRunner`).

    Each is called with ``prompts``, ``completions``, ``completion_ids`` and the prompt row's other
    columns (one value per rollout), concurrently: async ones awaited, sync ones in threads.
    """
    return await RewardRunner(reward_funcs, executor, timeout_s)(group)
