"""The rollout loop's scheduler: which group starts when, its rollouts, scoring, the queue.

:class:`GroupScheduler` walks the prompts (:mod:`trainer.rollout.prompt_order`) and starts a group
of ``num_generations`` rollouts for each prompt the loop's ``filter_prompt`` keeps, when the
staleness allowance has room for its tokens and the concurrency cap a free slot
(:mod:`trainer.rollout.concurrency`). Each rollout takes a slot and an environment and runs the
loop's ``run_rollout``; an environment lost mid-episode starts it over on another one. Each rollout
attempt runs on one vLLM server (:meth:`ServerFleet.run_routed
<trainer.rollout.servers.ServerFleet.run_routed>`: the least loaded; started over on another when
that server is lost) and records that server's policy version. A finished
group is reconciled into training sequences, waits on the score queue, is scored (reward sources,
the loop's ``compute_advantages``, the drop rule) and goes to the trainer. A group's failure (the
server is gone, a hook raised) stops the run.

The hooks it calls are :class:`~trainer.rollout.loop.AsyncRolloutLoop`'s; nothing here is meant
to be overridden.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import time
from collections.abc import Coroutine, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from sdk.exceptions import ServerDrainingError, ServerUnavailableError, SessionLostError, ToolgymError
from sdk.tools import environment_tools
from trainer.exceptions import PipelineStalledError, RolloutFailed, TrainerError
from trainer.records import QueuedGroup, Rollout, RolloutGroup, TrainingSample
from trainer.rollout.concurrency import AdaptiveCap, TokenAllowance
from trainer.rollout.env_pool import environment_reward, reset_environment
from trainer.rollout.prompt_order import PromptRow, check_prompt, is_stream, map_style_rows, stream_rows
from trainer.rollout.reconcile import reconcile_turns
from trainer.rollout.scoring import is_degenerate, reward_func_name, sum_rewards
from trainer.rollout.stats import group_stds, record_group_metrics, record_rollout_metrics
from trainer.rollout.tail import train_until_tail
from trainer.rollout.turn_baseline import turn_advantages
from trainer.rollout.worker import WorkerChannels

if TYPE_CHECKING:
    from trainer.rollout.loop import AsyncRolloutLoop

__all__ = ["ENV_RETRIES", "FAILING_ROLLOUTS_LIMIT", "GroupScheduler", "RolloutResult", "group_version"]

logger = logging.getLogger(__name__)

LOAD_POLL_S = 5.0
ALLOWANCE_POLL_S = 0.02
FAILING_ROLLOUTS_LIMIT = 32  # consecutive failed rollouts (none succeeding) before the run stops
ENV_RETRIES = 2  # restarts of a rollout on another environment after its env server or session was lost
# The env server or the session went away mid-episode: the rollout starts over on another instance.
_ENVIRONMENT_LOST = (ServerUnavailableError, SessionLostError, ServerDrainingError)
# The policy version the current rollout runs under (its server's when it started), seen by its
# requests (asyncio tasks copy it).
_GROUP_VERSION: contextvars.ContextVar[int | None] = contextvars.ContextVar("toolgym_group_version", default=None)

RolloutResult = tuple[list[dict[str, Any]], Rollout, tuple[type, float] | None]
"""One rollout's prompt (the environment's ``reset`` text included), the rollout, and the environment's
``(class, reward)`` (``None`` without an environment or a reward)."""


def group_version() -> int | None:
    """The policy version the current rollout started under: its server's version then (``None`` outside
    a rollout). The rollout's samples carry it; its group carries the oldest of its rollouts'."""
    return _GROUP_VERSION.get()


class GroupScheduler:
    """Starts, runs and scores the groups of one :class:`~trainer.rollout.loop.AsyncRolloutLoop`.

    Args:
        loop: The loop whose settings, hooks, environments and telemetry it uses.
        score_queue_maxsize: Finished groups waiting to be scored before generation blocks.
    """

    def __init__(self, loop: AsyncRolloutLoop, score_queue_maxsize: int) -> None:
        self.loop = loop
        # The gate on rollouts in flight: the one server's adaptive cap, or the sum over several servers.
        self.cap: AdaptiveCap = loop.sampler.gate
        self.allowance = TokenAllowance()
        self.score_queue: asyncio.Queue[tuple[RolloutGroup, list[Rollout], int, list[int]]] = asyncio.Queue(
            score_queue_maxsize)
        self.groups: set[asyncio.Task[None]] = set()  # groups in flight
        self._groups_started = 0  # group_id: groups counted from 0
        self._failed_in_a_row = 0
        # rollout_id -> (environment name, instance): held for the reward functions that declare
        # ``environments``, back to the pool once its group is scored
        self.held: dict[str, tuple[str | None, Any]] = {}
        self._failure: BaseException | None = None
        self._failed = asyncio.Event()
        self._versions: dict[str, int] = {}  # rollout_id -> the policy version of the server it ran on

    # ------------------------------------------------------------------------------ the run
    async def run(self, channels: WorkerChannels, stop: Coroutine[Any, Any, None],
                  *alongside: Coroutine[Any, Any, None]) -> None:
        """Produce and score groups until ``stop`` returns; the first task to fail raises its error.

        ``alongside`` run as long (the heartbeat, the metrics flush). On the way out every task is
        cancelled, the groups in flight too (they are abandoned: the trainer stopped).
        """
        tasks = [asyncio.create_task(c) for c in (stop, self.produce(channels), self.score_forever(),
                                                  self.poll_load(), self._watch_groups(), *alongside)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]  # checked just above
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Cancelled before the environments close under them, which would report every one as
            # a failed rollout.
            for group in self.groups:
                group.cancel()
            await asyncio.gather(*self.groups, return_exceptions=True)

    async def _watch_groups(self) -> None:
        """Raise the first group's failure (the server is gone, a hook raised...)."""
        await self._failed.wait()
        assert self._failure is not None
        raise self._failure

    def _group_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            self._failed.set()

    async def poll_load(self) -> None:
        """Every ``LOAD_POLL_S``: read each server's load, adjust its cap to it, record both."""
        while True:
            await self.loop.sampler.observe_load(self.loop.telemetry)
            await asyncio.sleep(LOAD_POLL_S)

    # --------------------------------------------------------------------------- producing
    def _prompt_stream(self, channels: WorkerChannels) -> Iterator[PromptRow]:
        """Yields (position, row_index, row, epoch) from the start position on, forever
        (:mod:`trainer.rollout.prompt_order`; a stream always from its first prompt)."""
        loop = self.loop
        if loop.dataset is None:
            return ((position, position, {}, 0) for position in itertools.count(loop.start_position))
        if is_stream(loop.dataset):
            def report_epoch_size(size: int) -> None:
                channels.epoch_size.value = size

            return stream_rows(loop.dataset, report_epoch_size)
        return map_style_rows(loop.dataset, loop.settings.seed, loop.start_position)

    async def produce(self, channels: WorkerChannels) -> None:
        """Start a group for every prompt kept, each when the allowance and the cap have room for it."""
        loop = self.loop
        rejected_in_a_row = 0
        for position, row_index, row, epoch in self._prompt_stream(channels):
            if position in loop.skip_positions:
                continue  # trained before the checkpoint this run resumed from
            if "prompt" in row:  # a map-style dataset was checked whole at start; a stream's rows are here
                check_prompt(row["prompt"], f"train_dataset row {row_index}")
            if not loop.filter_prompt(row_index, row, epoch):
                rejected_in_a_row += 1
                size = channels.epoch_size.value  # known at start, or after a stream's first pass
                if size > 0 and rejected_in_a_row >= size:
                    raise PipelineStalledError("filter_prompt rejected every prompt of a whole epoch: "
                                               "no batch can ever reach the trainer")
                loop.telemetry.put_group(QueuedGroup(position, row_index, dropped="filtered"))
                continue
            rejected_in_a_row = 0
            t0 = time.monotonic()
            waited = False
            while not self.allowance.may_start(channels.token_allowance.value, channels.consumed_tokens.value):
                waited = True
                await asyncio.sleep(ALLOWANCE_POLL_S)
            if waited:
                loop.records.add("rollout/backpressure_s", time.monotonic() - t0)
            await self.cap.wait_for_room()
            self.cap.reserve(loop.settings.num_generations)
            self.allowance.started()
            task = asyncio.create_task(self._run_group(position, row_index, row))
            self.groups.add(task)
            task.add_done_callback(self._group_done)
            task.add_done_callback(self.groups.discard)
            await asyncio.sleep(0)

    async def _run_group(self, position: int, row_index: int, row: dict[str, Any]) -> None:
        loop = self.loop
        version = loop.policy_version
        _GROUP_VERSION.set(version)  # this task's context, copied into its rollouts' tasks
        group_id, self._groups_started = self._groups_started, self._groups_started + 1
        results = await asyncio.gather(*(self.one_rollout(row, group_id, reserved=True)
                                         for _ in range(loop.settings.num_generations)),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, RolloutFailed):
                raise r
        ok = [r for r in results if isinstance(r, tuple)]
        if not ok:
            self.allowance.finished(0, 0)
            loop.telemetry.put_group(QueuedGroup(position, row_index, policy_version=version, dropped="failed"))
            return
        rollouts = [r for _, r, _ in ok]
        versions = [self._versions.pop(r.rollout_id, version) for r in rollouts]
        columns = {k: v for k, v in row.items() if k != "prompt"}  # reward functions get "environment" too
        sequences = []
        for rollout in rollouts:
            seqs, stats = reconcile_turns(rollout.turns)
            sequences.append(seqs)
            record_rollout_metrics(loop.records, rollout, seqs, stats, loop.eos_token_ids)
            loop.telemetry.generated_tokens += len(rollout.completion_ids)
        group = RolloutGroup(
            prompts=[p for p, _, _ in ok], reward_kwargs={k: [v] * len(rollouts) for k, v in columns.items()},
            completions=[r.completion for r in rollouts], completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=sequences, tool_call_counts=[r.tool_call_count for r in rollouts],
            tool_failure_counts=[r.tool_failure_count for r in rollouts], policy_version=min(versions),
            group_id=group_id,
            row_index=row_index, env_rewards=[e for _, _, e in ok], rollout_rewards=[r.reward for r in rollouts],
            queued_at=time.monotonic(), truncated=[r.truncated(loop.eos_token_ids) for r in rollouts],
        )
        t0 = time.monotonic()
        await self.score_queue.put((group, rollouts, position, versions))
        loop.records.add("rollout/score_block_s", time.monotonic() - t0)

    # ---------------------------------------------------------------------------- rollouts
    async def one_rollout(self, row: dict[str, Any], group_id: int, reserved: bool = False) -> RolloutResult:
        """Acquire a slot (promised to this rollout's group when ``reserved``) and an environment, run
        the loop's ``run_rollout``, score the environment.

        An env server or session lost mid-episode (the server died, was restarted, drains) starts
        the rollout over on another environment instance, whose ``reset`` opens a new session on a
        live replica (``rollout/env_retry_count``), at most ``ENV_RETRIES`` times; when no replica
        is reachable that ``reset`` raises ``ServerUnavailableError`` and the run stops. A vLLM server
        lost mid-rollout starts it over the same way, on another server (:mod:`trainer.rollout.servers`).
        """
        records = self.loop.records
        await self.cap.acquire(reserved)
        t0 = time.monotonic()
        retries = 0
        try:
            while True:
                try:
                    result = await self.loop.sampler.run_routed(
                        lambda server: self._attempt_on(server, row, group_id))
                except RolloutFailed as exc:
                    if not isinstance(exc.__cause__, _ENVIRONMENT_LOST) or retries == ENV_RETRIES:
                        self._rollout_failed(str(exc))
                        raise
                    retries += 1
                    logger.warning("rollout starts over on another environment: %s", exc)
                    records.add("rollout/env_retry_count", 1)
                    continue
                self._failed_in_a_row = 0
                return result
        finally:
            records.add("rollout/duration_s", time.monotonic() - t0)
            await self.cap.release()

    async def _attempt_on(self, server: int, row: dict[str, Any], group_id: int) -> RolloutResult:
        """One attempt bound to ``server`` (in its own task), under that server's policy version."""
        version = self.loop.sampler.version(server, self.loop.policy_version)
        _GROUP_VERSION.set(version)
        result = await self._rollout_on_an_environment(row, group_id)
        self._versions[result[1].rollout_id] = version
        return result

    async def _rollout_on_an_environment(self, row: dict[str, Any], group_id: int) -> RolloutResult:
        """One attempt: an environment from the pool (returned after success, dropped after failure)."""
        loop = self.loop
        prompt = list(row.get("prompt") or [])
        tools = list(loop.tools)
        if not loop.envs.enabled:
            return prompt, await loop.run_rollout(row, prompt, tools, None, group_id=group_id), None
        name = loop.envs.resolve(row)
        env = loop.envs.acquire(name)
        try:
            timeout_s = loop.settings.env_call_timeout
            prompt = await reset_environment(env, row, prompt, loop.executor, loop.records, timeout_s)
            tools += environment_tools(env)
            try:
                rollout = await loop.run_rollout(row, prompt, tools, env, group_id=group_id)
                env_reward = await environment_reward(env, loop.executor, loop.records, timeout_s)
            except TrainerError:
                raise  # the sampler or the trainer failed, not the environment
            except ToolgymError as exc:  # the env server or its session failed, not the model
                raise RolloutFailed(f"environment {type(env).__name__}: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            loop.envs.discard(env)  # its state is unknown: never handed to another rollout
            raise
        if loop.rewards.wants_environments:
            self.held[rollout.rollout_id] = (name, env)
        else:
            loop.envs.release(name, env)
        return prompt, rollout, env_reward

    async def score_with_environments(self, group: RolloutGroup, rollouts: list[Rollout]) -> list[list[float | None]]:
        """The reward functions on ``group``, those that declare ``environments`` given each rollout's
        (held since its episode ended); the environments then go back to the pool."""
        loop = self.loop
        held = [self.held.pop(r.rollout_id, None) for r in rollouts] if loop.rewards.wants_environments else []
        try:
            return await loop.rewards(group, [h[1] if h is not None else None for h in held] if held else None)
        finally:
            for h in held:
                if h is not None:
                    loop.envs.release(*h)

    def _rollout_failed(self, message: str) -> None:
        logger.warning("rollout failed: %s", message)
        self._failed_in_a_row += 1
        self.loop.records.add("rollout/failed_count", 1)
        if self._failed_in_a_row >= FAILING_ROLLOUTS_LIMIT:
            raise PipelineStalledError(f"every rollout is failing ({self._failed_in_a_row} in a row, none "
                                       f"succeeded); the last error: {message}")

    # ---------------------------------------------------------------------------- scoring
    async def score_forever(self) -> None:
        """Score each finished group in turn and send it to the trainer."""
        loop = self.loop
        records = loop.records
        while True:
            group, rollouts, position, versions = await self.score_queue.get()
            records.add("rollout/score_wait_s", time.monotonic() - group.queued_at)
            t0 = time.monotonic()
            queued = self.score(group, await self.score_with_environments(group, rollouts), position,
                                [r.rollout_id for r in rollouts], versions)
            for name, count in loop.rewards.take_timeouts().items():
                records.add(f"rewards/{name}/timeout_count", count)
            records.add("rollout/score_s", time.monotonic() - t0)
            total_tokens = sum(len(s.input_ids) for seqs in group.completions_sequences for s in seqs)
            self.allowance.finished(queued.tokens, total_tokens)
            loop.telemetry.put_group(queued)

    def score(self, group: RolloutGroup, func_rewards: list[list[float | None]], position: int,
              rollout_ids: list[str] | None = None, versions: list[int] | None = None) -> QueuedGroup:
        """Sum the group's reward sources, run the loop's ``compute_advantages``, and make its samples
        (none when the group is dropped: :mod:`trainer.rollout.scoring`); each sample carries its
        rollout's policy version (``versions``; the group's when ``None``)."""
        loop = self.loop
        mask_truncated = loop.settings.mask_truncated_completions
        n = len(group.completions)
        sources: dict[str, list[float | None]] = {
            reward_func_name(f): values for f, values in zip(loop.reward_funcs, func_rewards, strict=True)}
        env_names = {e[0].__name__ for e in group.env_rewards if e is not None}
        for env_name in env_names:
            sources[env_name] = [e[1] if e is not None and e[0].__name__ == env_name else None
                                 for e in group.env_rewards]
        if any(r is not None for r in group.rollout_rewards):
            sources["rollout"] = list(group.rollout_rewards)
        group.rewards = scored_rewards = sum_rewards(list(sources.values()), n)
        trained_rewards = group.rewards
        if mask_truncated and any(group.truncated):
            # A masked rollout is not trained, so it is left out of the baseline too: the advantages
            # of the rollouts that are trained still sum to zero, and a prefix they all share gets
            # no net push either way.
            trained_rewards = np.where(np.asarray(group.truncated), np.nan, group.rewards)
        dropped = is_degenerate(trained_rewards)
        record_group_metrics(loop.records, group, sources, dropped)  # every rollout's reward, truncated or not
        group.rewards = trained_rewards
        queued = QueuedGroup(position, group.row_index, policy_version=group.policy_version)
        # The hook runs for every group, a dropped one too (a curriculum tracks solved prompts there);
        # dropping is decided on the rewards above, not on what it returns.
        advantages = np.asarray(loop.compute_advantages(group), dtype=np.float64)
        if advantages.shape != (n,):
            raise ValueError(f"compute_advantages returned shape {advantages.shape}, expected ({n},)")
        if dropped:
            scored, trained = (int(np.sum(~np.isnan(r))) for r in (scored_rewards, trained_rewards))
            queued.dropped = "unscorable" if scored < 2 else "other" if trained < 2 else "zero_spread"
            return queued
        std, func_stds = group_stds(sources, trained_rewards)
        now = time.time()
        trained = ~np.isnan(trained_rewards)  # scored, and not masked as truncated
        per_token: list[list[list[float] | None]] = [[None] * len(seqs) for seqs in group.completions_sequences]
        if loop.settings.turn_baseline:
            per_token, shared, turns = turn_advantages(group.completions_sequences, advantages.tolist(),
                                                       trained.tolist())
            loop.records.add_rate("rollout/turn_baseline_frac", shared, turns)
        for i, seqs in enumerate(group.completions_sequences):
            if mask_truncated and group.truncated[i]:
                continue  # masked: out of the baseline above, and out of the loss
            kept, untrained = train_until_tail(seqs, loop.settings.tail_token_prob)
            loop.records.add_rate("rollout/tail_truncated_frac", int(untrained > 0), 1)
            loop.records.add_rate("rollout/tail_untrained_frac", untrained,
                                  untrained + sum(seq.num_trained for seq in kept))
            for seq, token_advantages in zip(kept, per_token[i], strict=False):  # the tail drops only later ones
                queued.samples.append(TrainingSample(
                    sequence=seq, advantage=float(advantages[i]), group_id=group.group_id,
                    policy_version=versions[i] if versions else group.policy_version, row_index=group.row_index,
                    reward=float(group.rewards[i]), queued_at=now,
                    rollout_id=rollout_ids[i] if rollout_ids else "", reward_group_std=std,
                    reward_func_group_stds=func_stds, token_advantages=token_advantages))
        queued.tokens = sum(s.num_tokens for s in queued.samples)
        return queued
