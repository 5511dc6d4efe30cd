"""Held-out evaluation through the same machinery as training: the vLLM server, the rollout loop's
multi-turn rollouts and scoring (:mod:`trainer.rollout.eval_episodes`) and the environment (local or
on an env server). ``toolgym eval`` is this, with a table and files::

    settings = RolloutSettings.from_server(base_url, model_dir, max_completion_length=48,
                                           max_tool_calling_iterations=8)
    run = evaluate(settings, [{"target": t} for t in range(1, 7)], num_generations=8,
                   environment_factory=remote_factory(url, "IncrementEnv"), group_by="target")
    run.summary.success_rate       # Estimate(value, low, high, n): a Wilson 95 % interval
    run.summary.pass_at_k[4]       # unbiased pass@4 over the six prompts
    run.episodes[0].completion     # what the model did in one episode

:func:`evaluate_policy` is the short form the benchmarks use (the environment's reward, four numbers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trainer.rollout.env_pool import EnvironmentFactory
from trainer.rollout.eval_episodes import run_episodes_on_own_loop
from trainer.rollout.eval_results import EpisodeResult, EvalSummary, summarize
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.scoring import RewardFunc
from trainer.rollout.settings import RolloutSettings

__all__ = ["EvalRun", "PolicyEval", "evaluate", "evaluate_policy"]


@dataclass
class EvalRun:
    """A finished evaluation.

    Attributes:
        episodes: Every episode, in the order they finished.
        summary: Their figures (:func:`~trainer.rollout.eval_results.summarize`).
    """

    episodes: list[EpisodeResult]
    summary: EvalSummary


def evaluate(settings: RolloutSettings, rows: Sequence[dict[str, Any]], num_generations: int = 8, *,
             environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory] | None = None,
             reward_funcs: Sequence[RewardFunc] = (), tools: list[Callable[..., Any]] | None = None,
             group_by: str | None = None, success_threshold: float = 1.0, concurrency: int | None = None,
             on_episode: Callable[[EpisodeResult], None] | None = None,
             processing_class: PreTrainedTokenizerBase | None = None) -> EvalRun:
    """Evaluate the served policy: ``num_generations`` episodes of every row, as training runs them.

    Builds an :class:`~trainer.rollout.loop.AsyncRolloutLoop` on ``settings``, runs
    :func:`~trainer.rollout.eval_episodes.run_episodes_on_own_loop` on it. Interrupted (Ctrl-C),
    it raises ``KeyboardInterrupt`` after closing everything; ``on_episode`` has seen every episode
    that finished.

    Args:
        settings: The server, the model (its tokenizer is loaded from ``settings.model_name`` unless
            ``processing_class`` is given) and the sampling settings (:meth:`RolloutSettings.from_server`).
        rows: Dataset rows (a ``prompt``, ``reset``'s keyword arguments).
        num_generations: Episodes per row.
        environment_factory: The environment(s), as the trainer takes them.
        reward_funcs: Reward functions, as the trainer takes them.
        tools: Tool functions, as the trainer takes them.
        group_by: A row column naming each row's task (:func:`~trainer.rollout.eval_episodes.task_of`).
        success_threshold: An episode succeeds when its reward is at least this.
        concurrency: Most episodes in flight; default ``settings.max_concurrent_rollouts``.
        on_episode: Called with each episode as it finishes.
        processing_class: The tokenizer.

    Raises:
        RolloutWorkerError: Every episode is failing (``FAILING_ROLLOUTS_LIMIT`` in a row).
        VLLMServerError: The vLLM server failed.
        ServerUnavailableError: No env server is reachable.
    """
    tokenizer = processing_class or AutoTokenizer.from_pretrained(settings.model_name)
    loop = AsyncRolloutLoop(settings, tokenizer, reward_funcs=reward_funcs, tools=tools,
                            environment_factory=environment_factory)
    episodes = asyncio.run(run_episodes_on_own_loop(
        loop, rows, num_generations, concurrency or settings.max_concurrent_rollouts, group_by=group_by,
        success_threshold=success_threshold, on_episode=on_episode))
    return EvalRun(episodes, summarize(episodes))


@dataclass
class PolicyEval:
    """Outcome of an evaluation, in short.

    Attributes:
        episodes: Rollouts run.
        success_rate: Episodes whose environment reward reached 1.0, over the episodes.
        tool_calls_per_episode: Mean tool calls per rollout.
        failed_tool_call_frac: Failed tool calls / tool calls (0 when there are none).
        run: The whole evaluation: every episode, the summary with its intervals and pass@k.
    """

    episodes: int
    success_rate: float
    tool_calls_per_episode: float
    failed_tool_call_frac: float
    run: EvalRun | None = None


def evaluate_policy(
    settings: RolloutSettings,
    environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory],
    rows: list[dict[str, Any]],
    samples_per_row: int = 8,
    concurrency: int = 32,
    group_by: str | None = None,
) -> PolicyEval:
    """Run ``samples_per_row`` episodes per row against the served policy, scored by the environment.

    Args:
        settings: The server, the model and the sampling settings (:meth:`RolloutSettings.from_server`).
        environment_factory: The environment each rollout runs in (it scores with ``get_reward``).
        rows: Dataset rows (``reset``'s keyword arguments, a ``prompt`` if any).
        samples_per_row: Rollouts per row.
        concurrency: Most rollouts in flight.
        group_by: A row column naming each row's task in ``run.summary.tasks``.
    """
    run = evaluate(settings, rows, samples_per_row, environment_factory=environment_factory, group_by=group_by,
                   concurrency=concurrency)
    summary = run.summary
    return PolicyEval(episodes=summary.episodes, success_rate=summary.success_rate.value,
                      tool_calls_per_episode=summary.tool_calls_per_episode,
                      failed_tool_call_frac=summary.failed_tool_call_frac, run=run)
