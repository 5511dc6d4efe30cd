"""Evaluation episodes, run and scored exactly as training runs and scores its rollouts.

Each episode is one rollout of the training loop's scheduler
(:meth:`GroupScheduler.one_rollout <trainer.rollout.scheduler.GroupScheduler.one_rollout>`: a slot under
the same concurrency cap, an environment from the same pool, the loop's ``run_rollout`` with its turn
loop and the family's tool-call parser), scored by the same sources (the reward functions through
the loop's :class:`~trainer.rollout.scoring.RewardRunner`, the environment's ``get_reward``,
``Rollout.reward``) and summed the same way. Nothing is reconciled, queued or trained.

:func:`run_episodes` runs them on any loop: one built for the evaluation
(:func:`trainer.rollout.evaluation.evaluate`, ``toolgym eval``) or the training worker's.

What differs from training: the reward functions see one episode per call (lists of one), so that
every finished episode is complete on its own (an evaluation stopped with Ctrl-C keeps them); and an
episode that fails (its environment's ``reset`` raised, a reward function raised) is recorded with
its error and counts as unsuccessful instead of stopping the run. What stops it: the vLLM server
failing, no env server reachable, or every episode failing (``FAILING_ROLLOUTS_LIMIT`` in a row).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from trainer.exceptions import ConfigError, RewardFunctionError, RewardTimeoutError, RolloutFailed
from trainer.records import Rollout, RolloutGroup
from trainer.rollout.chat_template import completion_text, rollout_family
from trainer.rollout.concurrency import AdaptiveCap
from trainer.rollout.eval_results import EpisodeResult
from trainer.rollout.scoring import RewardFunc, reward_func_name, sum_rewards

if TYPE_CHECKING:
    from trainer.rollout.loop import AsyncRolloutLoop

__all__ = ["reward_sources", "run_episodes", "run_episodes_on_own_loop", "task_of"]


def reward_sources(reward_funcs: Sequence[RewardFunc], func_rewards: Sequence[Sequence[float | None]],
                   env_rewards: Sequence[tuple[type, float] | None],
                   rollout_rewards: Sequence[float | None]) -> dict[str, list[float | None]]:
    """Each reward source's values, one per rollout, named as training logs them (``rewards/<name>/...``).

    The reward functions by name, each environment by its class name, ``"rollout"`` for
    ``Rollout.reward`` when any rollout has one.
    """
    sources: dict[str, list[float | None]] = {
        reward_func_name(f): list(values) for f, values in zip(reward_funcs, func_rewards, strict=True)}
    for env_name in sorted({e[0].__name__ for e in env_rewards if e is not None}):
        sources[env_name] = [e[1] if e is not None and e[0].__name__ == env_name else None for e in env_rewards]
    if any(r is not None for r in rollout_rewards):
        sources["rollout"] = list(rollout_rewards)
    return sources


def task_of(row: Mapping[str, Any], group_by: str | None, routed: bool) -> str | None:
    """The task an episode of ``row`` counts under: ``"<group_by>=<value>"``, else its environment when
    the rows are routed to several (``"environment=<name>"``), else ``None`` (the whole run only)."""
    if group_by is not None:
        return f"{group_by}={row.get(group_by)}"
    if routed:
        return f"environment={row.get('environment')}"
    return None


async def run_episodes(loop: AsyncRolloutLoop, rows: Sequence[dict[str, Any]], num_generations: int, *,
                       group_by: str | None = None, success_threshold: float = 1.0,
                       on_episode: Callable[[EpisodeResult], None] | None = None) -> list[EpisodeResult]:
    """Run ``num_generations`` episodes of every row on ``loop``; returns them in the order they finished.

    Args:
        loop: The rollout loop (the training worker's, or one built for the evaluation).
        rows: Dataset rows: a ``prompt``, and ``reset``'s keyword arguments.
        num_generations: Episodes per row (the ``n`` of pass@k).
        group_by: A row column naming each row's task (:func:`task_of`).
        success_threshold: An episode succeeds when its reward is at least this.
        on_episode: Called with each episode as it finishes (a progress bar; keeping what finished
            when the evaluation is interrupted).

    Raises:
        ConfigError: A row lacks the ``group_by`` column.
        RolloutWorkerError: Every episode is failing.
        VLLMServerError: The vLLM server failed.
        ServerUnavailableError: No env server is reachable.
    """
    if group_by is not None:
        missing = [i for i, row in enumerate(rows) if group_by not in row]
        if missing:
            raise ConfigError(f"group_by={group_by!r}: row {missing[0]} has no such column (its columns: "
                              f"{sorted(rows[missing[0]])}); name one of them, or leave group_by out")
    routed = loop.envs.routed
    jobs = [asyncio.ensure_future(_episode(loop, row, i, j, task_of(row, group_by, routed), success_threshold))
            for i, row in enumerate(rows) for j in range(num_generations)]
    finished: list[EpisodeResult] = []
    try:
        for job in asyncio.as_completed(jobs):
            episode = await job
            finished.append(episode)
            if on_episode is not None:
                on_episode(episode)
    finally:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
    return finished


async def run_episodes_on_own_loop(loop: AsyncRolloutLoop, rows: Sequence[dict[str, Any]], num_generations: int,
                                   concurrency: int, *, group_by: str | None = None, success_threshold: float = 1.0,
                                   on_episode: Callable[[EpisodeResult], None] | None = None) -> list[EpisodeResult]:
    """:func:`run_episodes` on a loop built for them alone: at most ``concurrency`` in flight (a fixed cap:
    nothing polls the server's load, nothing else shares it), the loop's ``setup`` before and its
    environments, sampler client, ``close`` and threads released after (the loop is spent)."""
    loop.scheduler.cap = AdaptiveCap(concurrency, None, loop.settings.server.max_model_len)
    await loop.setup()
    try:
        return await run_episodes(loop, rows, num_generations, group_by=group_by,
                                  success_threshold=success_threshold, on_episode=on_episode)
    finally:
        await loop.envs.aclose()
        await loop.sampler.close()
        await loop.close()
        loop.executor.shutdown(wait=False, cancel_futures=True)


async def _episode(loop: AsyncRolloutLoop, row: dict[str, Any], row_index: int, sample_index: int,
                   task: str | None, success_threshold: float) -> EpisodeResult:
    version = loop.policy_version
    t0 = time.monotonic()
    episode = EpisodeResult(row_index=row_index, sample_index=sample_index, task=task, policy_version=version,
                            prompt=list(row.get("prompt") or []))
    try:
        episode.prompt, rollout, env_reward = await loop.scheduler.one_rollout(row, group_id=row_index)
    except RolloutFailed as exc:
        episode.error = str(exc)
        episode.duration_s = time.monotonic() - t0
        return episode
    _describe(loop, episode, rollout)
    try:
        sources = await _score(loop, row, episode.prompt, rollout, env_reward, version)
    except (RewardFunctionError, RewardTimeoutError) as exc:
        episode.error = str(exc)
    else:
        episode.rewards = {name: values[0] for name, values in sources.items()}
        total = float(sum_rewards(list(sources.values()), 1)[0])
        episode.reward = None if math.isnan(total) else total
        episode.success = episode.reward is not None and episode.reward >= success_threshold
    episode.duration_s = time.monotonic() - t0
    return episode


def _describe(loop: AsyncRolloutLoop, episode: EpisodeResult, rollout: Rollout) -> None:
    """Copy what the rollout did into the episode's record."""
    family = rollout_family(loop.settings.chat_template or loop.tokenizer.chat_template)
    texts = [completion_text(loop.tokenizer, turn.output_ids, loop.eos_token_ids) for turn in rollout.turns]
    episode.completion = rollout.completion
    episode.tool_calls = rollout.tool_call_count
    episode.failed_tool_calls = rollout.tool_failure_count
    episode.malformed_tool_calls = sum(family.malformed(text) for text in texts)
    episode.turns = len(rollout.turns)
    episode.prompt_tokens = len(rollout.turns[0].prompt_ids) if rollout.turns else 0
    episode.completion_tokens = len(rollout.completion_ids)
    episode.truncated = rollout.truncated(loop.eos_token_ids)


async def _score(loop: AsyncRolloutLoop, row: dict[str, Any], prompt: list[dict[str, Any]], rollout: Rollout,
                 env_reward: tuple[type, float] | None, version: int) -> dict[str, list[float | None]]:
    """The episode's reward sources, the reward functions called as training calls them."""
    columns = {k: [v] for k, v in row.items() if k != "prompt"}
    group = RolloutGroup(
        prompts=[prompt], reward_kwargs=columns, completions=[rollout.completion],
        completions_ids=[rollout.completion_ids], completions_sequences=[[]],
        tool_call_counts=[rollout.tool_call_count], tool_failure_counts=[rollout.tool_failure_count],
        policy_version=version, group_id=-1, row_index=-1, env_rewards=[env_reward],
        rollout_rewards=[rollout.reward], truncated=[rollout.truncated(loop.eos_token_ids)])
    func_rewards = await loop.scheduler.score_with_environments(group, [rollout]) if loop.reward_funcs else []
    return reward_sources(loop.reward_funcs, func_rewards, [env_reward], [rollout.reward])
