"""Evaluation during training: the trainer asks, the rollout worker runs the episodes beside training's.

``AsyncGRPOTrainer.evaluate`` (called by ``transformers`` at ``eval_strategy`` / ``eval_steps`` /
``eval_on_start``, or by you) puts an :class:`EvalRequest` on the worker's ``eval_requests`` queue
and waits for its :class:`EvalReply`, checking the worker's health as it waits for groups. In the
worker, :func:`serve_evaluations` runs beside the training loop on the same event loop: for each
request it builds a second loop of the run's ``loop_cls`` (the same settings but the evaluation's
temperature, the same hooks, tools, environments and reward functions, no dataset) and runs
:func:`~trainer.rollout.eval_episodes.run_episodes` on it. Training's generation goes on meanwhile;
the evaluation's rollouts are never reconciled or queued, so none of them reaches training. Each
episode samples from the newest policy version (its version is in the episode's record).

Outside training (no worker), :func:`evaluate_outside_training` runs the same episodes in this
process, against the server's weights as they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from trainer.config import AsyncGRPOConfig
from trainer.exceptions import ConfigError, RolloutWorkerError
from trainer.rollout.eval_episodes import run_episodes_on_own_loop
from trainer.rollout.eval_results import EpisodeResult, summarize, write_run
from trainer.rollout.prompt_order import is_stream
from trainer.rollout.settings import RolloutSettings

if TYPE_CHECKING:
    from trainer.rollout.loop import AsyncRolloutLoop
    from trainer.rollout.worker import RolloutWorker, WorkerChannels

__all__ = [
    "SEEDED_ROWS",
    "EpochEvaluation",
    "EvalPlan",
    "EvalReply",
    "EvalRequest",
    "eval_rows",
    "evaluate_outside_training",
    "evaluation_loop",
    "record_evaluation",
    "request_evaluation",
    "run_with_evaluations",
    "serve_evaluations",
]

SEEDED_ROWS = 16
"""Environment episodes evaluated without an ``eval_dataset`` (``eval_num_rows`` unset)."""
POLL_S = 0.1
TRAINING_ONLY_KWARGS = ("dataset", "dataset_start_index", "dataset_skip_positions")
"""The loop's constructor arguments an evaluation loop does not get: it walks no training data."""


@dataclass(frozen=True)
class EvalPlan:
    """What one evaluation runs (it pickles: it crosses to the worker).

    Attributes:
        rows: The rows (a ``prompt``, ``reset``'s keyword arguments).
        num_generations: Episodes per row.
        temperature: Sampling temperature (0: greedy).
        group_by: A row column naming each row's task.
        success_threshold: An episode succeeds when its reward is at least this.
    """

    rows: tuple[dict[str, Any], ...]
    num_generations: int
    temperature: float
    group_by: str | None
    success_threshold: float

    @classmethod
    def from_config(cls, args: AsyncGRPOConfig, rows: Sequence[dict[str, Any]]) -> EvalPlan:
        """The plan of ``args``' ``eval_*`` fields for ``rows``."""
        return cls(rows=tuple(rows), num_generations=args.eval_num_generations or args.num_generations,
                   temperature=args.temperature if args.eval_temperature is None else args.eval_temperature,
                   group_by=args.eval_group_by, success_threshold=args.eval_success_threshold)


@dataclass(frozen=True)
class EvalRequest:
    """Trainer -> worker: run ``plan`` and answer with ``request_id``."""

    request_id: int
    plan: EvalPlan


@dataclass(frozen=True)
class EvalReply:
    """Worker -> trainer: the episodes of request ``request_id``, or the traceback that stopped it."""

    request_id: int
    episodes: list[EpisodeResult]
    error: str | None = None


def eval_rows(eval_dataset: Any, num_rows: int | None, has_environment: bool) -> list[dict[str, Any]]:
    """The rows an evaluation runs: ``eval_dataset``'s first ``num_rows`` (all when ``None``; a stream is
    read that far, or to its end), else ``num_rows`` seeded environment episodes (``{"seed": i}``).

    Raises:
        ConfigError: No ``eval_dataset`` and no environment, or an empty ``eval_dataset``.
    """
    if eval_dataset is None:
        if not has_environment:
            raise ConfigError("evaluation needs an eval_dataset (rows with a 'prompt' and the reward functions' "
                              "columns), or an environment_factory whose seeded episodes are evaluated; set one, or "
                              "eval_strategy='no' and eval_on_start=False")
        return [{"seed": i} for i in range(num_rows or SEEDED_ROWS)]
    limit = num_rows if num_rows is not None else (None if is_stream(eval_dataset) else len(eval_dataset))
    rows = [dict(row) for row in itertools.islice(iter(eval_dataset), limit)]
    if not rows:
        raise ConfigError("eval_dataset holds no rows: give it rows, or leave it out to evaluate seeded episodes "
                          "of the environment")
    return rows


# ------------------------------------------------------------------------------ the worker's side
def evaluation_loop(loop_cls: type[AsyncRolloutLoop], settings: RolloutSettings, loop_kwargs: dict[str, Any],
                    channels: WorkerChannels | None, plan: EvalPlan) -> AsyncRolloutLoop:
    """A loop for one evaluation: the run's class, settings and constructor arguments, the plan's
    temperature, no training data."""
    kwargs = {k: v for k, v in loop_kwargs.items() if k not in TRAINING_ONLY_KWARGS}
    return loop_cls(dataclasses.replace(settings, temperature=plan.temperature), channels=channels, **kwargs)


async def run_plan(loop: AsyncRolloutLoop, plan: EvalPlan) -> list[EpisodeResult]:
    """Run ``plan`` on ``loop``, at most ``max_concurrent_rollouts`` episodes in flight; the loop is spent after."""
    return await run_episodes_on_own_loop(loop, plan.rows, plan.num_generations, loop.settings.max_concurrent_rollouts,
                                          group_by=plan.group_by, success_threshold=plan.success_threshold)


async def serve_evaluations(make_loop: Callable[[EvalPlan], AsyncRolloutLoop], channels: WorkerChannels) -> None:
    """Answer the trainer's evaluation requests, one at a time, until cancelled (the worker stops).

    An evaluation that fails (every episode failing, the server gone...) answers with its traceback:
    the trainer raises it.
    """
    while True:
        try:
            request = channels.eval_requests.get_nowait()
        except queue.Empty:
            await asyncio.sleep(POLL_S)
            continue
        try:
            reply = EvalReply(request.request_id, await run_plan(make_loop(request.plan), request.plan))
        except Exception:
            reply = EvalReply(request.request_id, [], traceback.format_exc())
        channels.eval_results.put(reply)


async def run_with_evaluations(loop: AsyncRolloutLoop, make_loop: Callable[[EvalPlan], AsyncRolloutLoop],
                               channels: WorkerChannels) -> None:
    """The worker's work: ``loop.run()`` with :func:`serve_evaluations` beside it, which stops with it."""
    evaluations = asyncio.create_task(serve_evaluations(make_loop, channels))
    try:
        await loop.run()
    finally:
        evaluations.cancel()
        await asyncio.gather(evaluations, return_exceptions=True)


# ----------------------------------------------------------------------------- the trainer's side
_REQUEST_IDS = itertools.count()


class EpochEvaluation(TrainerCallback):  # type: ignore[misc]  # transformers' callbacks are untyped
    """``eval_strategy="epoch"``: evaluate after the step that completes an epoch.

    This trainer's epochs count prompts trained (``state.epoch``, set at each step's end), not passes of
    a DataLoader, so ``transformers``' own end-of-epoch hook would fire only when the run ends.
    """

    def __init__(self) -> None:
        self.epochs_done = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """Ask for an evaluation when ``state.epoch`` crossed a whole number."""
        epochs = int(state.epoch or 0)
        if args.eval_strategy == "epoch" and epochs > self.epochs_done:
            self.epochs_done = epochs
            control.should_evaluate = True


def request_evaluation(worker: RolloutWorker, plan: EvalPlan) -> list[EpisodeResult]:
    """Have the worker run ``plan``; waits for its episodes, raising the worker's failure if it fails.

    Raises:
        RolloutWorkerError: The evaluation failed (the worker's traceback), or the worker did.
    """
    request_id = next(_REQUEST_IDS)
    worker.channels.eval_requests.put(EvalRequest(request_id, plan))
    while True:
        try:
            reply = worker.channels.eval_results.get(timeout=0.5)
        except queue.Empty:
            worker.check()
            continue
        if reply.request_id != request_id:
            continue  # the answer to an evaluation interrupted on this side: nobody waits for it
        if reply.error is not None:
            raise RolloutWorkerError(f"the evaluation failed in the rollout worker:\n{reply.error}")
        return reply.episodes


def record_evaluation(episodes: list[EpisodeResult], folder: Path, prefix: str, runtime_s: float,
                      about: dict[str, Any]) -> dict[str, float]:
    """Write an evaluation's ``results.jsonl`` and ``summary.json`` into ``folder``; returns its metrics
    (:meth:`~trainer.rollout.eval_results.EvalSummary.metrics`, plus ``{prefix}_runtime`` in seconds
    and ``{prefix}_policy_version``, the oldest version an episode sampled from)."""
    summary = summarize(episodes)
    write_run(folder, episodes, summary, about)
    metrics = summary.metrics(prefix)
    metrics[f"{prefix}_runtime"] = runtime_s
    metrics[f"{prefix}_policy_version"] = float(min((e.policy_version for e in episodes), default=0))
    return metrics


def evaluate_outside_training(settings: RolloutSettings, plan: EvalPlan, loop_cls: type[AsyncRolloutLoop],
                              loop_kwargs: dict[str, Any]) -> list[EpisodeResult]:
    """Run ``plan`` in this process (no rollout worker: before or after training), on the server's weights."""
    return asyncio.run(run_plan(evaluation_loop(loop_cls, settings, loop_kwargs, None, plan), plan))
