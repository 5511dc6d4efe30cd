"""Held-out evaluation through the same machinery as training: the vLLM server, the rollout loop's
multi-turn rollouts (:meth:`AsyncRolloutLoop.evaluate`) and the environment (local or on an env server).

    settings = RolloutSettings.from_server(base_url, model_dir, max_completion_length=48,
                                           max_tool_calling_iterations=8)
    result = evaluate_policy(settings, remote_factory(url, "IncrementEnv"),
                             rows=[{"target": t} for t in range(1, 7)], samples_per_row=8)
    result.success_rate     # mean environment reward (1.0 = goal reached)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer

from trainer.rollout.env_pool import EnvironmentFactory
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.settings import RolloutSettings


@dataclass
class PolicyEval:
    """Outcome of an evaluation.

    Attributes:
        episodes: Rollouts run.
        success_rate: Mean environment reward.
        tool_calls_per_episode: Mean tool calls per rollout.
        failed_tool_call_frac: Failed tool calls / tool calls (0 when there are none).
    """

    episodes: int
    success_rate: float
    tool_calls_per_episode: float
    failed_tool_call_frac: float


def evaluate_policy(
    settings: RolloutSettings,
    environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory],
    rows: list[dict[str, Any]],
    samples_per_row: int = 8,
    concurrency: int = 32,
) -> PolicyEval:
    """Run ``samples_per_row`` rollouts per row against the served policy; average the env rewards.

    Args:
        settings: The server, the model (its tokenizer is loaded from ``settings.model_name``) and the
            sampling settings (:meth:`RolloutSettings.from_server`).
        environment_factory: The environment each rollout runs in (it scores with ``get_reward``).
        rows: Dataset rows (``reset``'s keyword arguments, a ``prompt`` if any).
        samples_per_row: Rollouts per row.
        concurrency: Most rollouts in flight.
    """
    tokenizer = AutoTokenizer.from_pretrained(settings.model_name)
    loop = AsyncRolloutLoop(settings, tokenizer, environment_factory=environment_factory)
    results = asyncio.run(loop.evaluate(rows, samples_per_row, concurrency))
    rewards = [e[1] if e is not None else 0.0 for _, _, e in results]
    calls = sum(r.tool_call_count for _, r, _ in results)
    failures = sum(r.tool_failure_count for _, r, _ in results)
    return PolicyEval(
        episodes=len(results),
        success_rate=sum(rewards) / len(results),
        tool_calls_per_episode=calls / len(results),
        failed_tool_call_frac=failures / calls if calls else 0.0,
    )
