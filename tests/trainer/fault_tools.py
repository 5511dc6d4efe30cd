"""What the trainer fault tests inject: an env server that dies on cue, rewards that hang or raise.

Importable by the env server subprocess (``python -m envserver.cli tests.trainer.fault_tools:DyingCounter``)
and by the spawned rollout worker, so everything here is module level.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from environments.counter import IncrementEnv
from tests.trainer.spread_reward import token_reward
from trainer.async_grpo_trainer import AsyncRolloutLoop
from trainer.launch.envserver import EnvServerProcess
from trainer.records import RolloutGroup

REPO = Path(__file__).resolve().parents[2]
KILL_AT_ENV = "TOOLGYM_FAULT_KILL_AT"  # the server process SIGKILLs itself at its N-th get_reward
DYING_COUNTER = "counter=tests.trainer.fault_tools:DyingCounter"  # the spec for toolgym serve


def dying_counter_server(port: int | None = None, kill_at: int | None = None) -> EnvServerProcess:
    """An env server subprocess hosting ``DyingCounter`` as ``counter`` (not started), dying at its
    ``kill_at``-th ``get_reward`` (``None``: never); sessions stay resumable 30 s after a drop."""
    return EnvServerProcess([DYING_COUNTER], port=port, args=["--resume_grace", "30"], cwd=str(REPO), quiet=True,
                            env={KILL_AT_ENV: str(kill_at)} if kill_at is not None else {})


class DyingCounter(IncrementEnv):
    """The counter, whose server process kills itself (SIGKILL) during its N-th ``get_reward`` call,
    N from ``$TOOLGYM_FAULT_KILL_AT`` (never when unset): a server dying mid-episode, on cue."""

    calls = 0  # per server process: every session's instance counts

    def get_reward(self) -> float:
        """1.0 when the counter equals the target, else 0.0 (or the server dies here)."""
        DyingCounter.calls += 1
        if str(DyingCounter.calls) == os.environ.get(KILL_AT_ENV):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().get_reward()


def rank_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """``0, 1, 2, ...`` by rollout: every group has spread, so every group trains (none is dropped)."""
    return [float(i) for i in range(len(completion_ids))]


def hang_on_row_one(completion_ids: list[list[int]], row_id: list[int], **kwargs: Any) -> list[float]:
    """``token_reward``, but hangs on row 1 (a sync sleep, as math-verify can on a pathological answer)."""
    if row_id[0] == 1:
        time.sleep(3600)
    return token_reward(completion_ids)


def always_hangs(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Hangs on every group."""
    time.sleep(3600)
    return [0.0] * len(completion_ids)


async def async_always_hangs(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Awaits forever (an async reward function whose backend never answers)."""
    import asyncio

    await asyncio.sleep(3600)
    return [0.0] * len(completion_ids)


def exploding_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Raises on every group."""
    raise ZeroDivisionError("the grader divided by zero on purpose")


def inf_for_the_first(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """``inf`` for each group's first rollout (a grader's division by zero), ``rank_reward`` for the rest."""
    return [math.inf] + rank_reward(completion_ids)[1:]


class NaNAdvantageLoop(AsyncRolloutLoop):
    """A loop whose ``compute_advantages`` divides by a zero spread: every advantage is ``nan``."""

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """``nan`` for every rollout."""
        return np.full(len(group.completions), np.nan)
