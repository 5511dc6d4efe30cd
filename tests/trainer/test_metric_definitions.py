"""The source's definitions of the metrics that once meant something else, each on a known window.

``sampling/sampler_mass`` exists only with score centering; ``reward_group_std`` and
``rewards/{f}/group_std`` average the group standard deviations over the samples trained (a group dropped
as stale counts for nothing); ``rollout/queue_size`` counts samples, not groups. The stream is fed by an
in-memory queue standing in for the rollout worker's process boundary (what is tested is the trainer side).
"""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch

from tests.trainer.training.test_loss import logps_from, make_row
from trainer.metrics import MetricWindow, RecordBuffer
from trainer.records import QueuedGroup, RolloutGroup, TrainingSample, TrainingSequence
from trainer.rollout.stats import group_stds, record_group_metrics
from trainer.training.batching import MicroBatchStream
from trainer.training.loss import LossConfig, grpo_loss, loss_metrics


class QueueSource:
    """The :class:`~trainer.records.GroupSource` protocol over an in-process queue of groups."""

    def __init__(self, groups: list[QueuedGroup]) -> None:
        self.queue: queue.Queue[QueuedGroup] = queue.Queue()
        for group in groups:
            self.queue.put(group)
        self.samples_put = sum(len(g.samples) for g in groups)

    def get(self, timeout_s: float | None = None) -> QueuedGroup | None:
        """The next group, or ``None`` when empty."""
        try:
            return self.queue.get(timeout=timeout_s) if timeout_s else self.queue.get_nowait()
        except queue.Empty:
            return None

    def qsize(self) -> int:
        """Groups waiting."""
        return self.queue.qsize()

    def queued_samples(self) -> int:
        """Samples put on the queue so far (the worker's running count)."""
        return self.samples_put

    def epoch_size(self) -> int | None:
        """Unknown (a stream before the end of its first pass)."""
        return None

    def add_consumed_tokens(self, tokens: int) -> None:
        """Unused here."""


def _group(position: int, n: int, version: int, std: float, func_stds: dict[str, float]) -> QueuedGroup:
    """``n`` samples of 3 tokens sharing nothing (so a row of 6 tokens holds two)."""
    samples = [TrainingSample(
        sequence=TrainingSequence(input_ids=[100 * position + 3 * i + t for t in (1, 2, 3)], loss_mask=[0, 1, 1],
                                  sampler_logprobs=[0.0, -1.0, -1.0]),
        advantage=1.0, group_id=position, policy_version=version, reward_group_std=std,
        reward_func_group_stds=func_stds) for i in range(n)]
    return QueuedGroup(position, position, samples=samples, tokens=3 * n, policy_version=version)


def test_sampler_mass_is_logged_only_with_score_centering() -> None:
    z = torch.randn(3, 12)
    row = make_row(torch.arange(3), torch.full((3,), -1.0), torch.ones(3), torch.tensor([[0, 1]] * 3),
                   torch.log(torch.tensor([[0.5, 0.25]] * 3)))
    for centering in (True, False):
        _, stats = grpo_loss(logps_from(z, row), row, LossConfig(score_centering=centering), 3)
        metrics = loss_metrics(stats)
        assert ("sampling/sampler_mass" in metrics) is centering
        if centering:
            assert metrics["sampling/sampler_mass"] == pytest.approx(0.75)


def test_group_stds_average_over_trained_samples_and_skip_stale_groups() -> None:
    groups = [_group(0, 3, version=5, std=1.0, func_stds={"f": 0.5}),
              _group(1, 1, version=5, std=3.0, func_stds={"f": 1.5}),
              _group(2, 2, version=0, std=100.0, func_stds={"f": 100.0})]  # 5 versions old: dropped
    window = MetricWindow()
    stream = MicroBatchStream(QueueSource(groups), num_rows=1, token_budget=1000, max_staleness=2, metrics=window)
    stream.policy_version = 5
    batch = next(stream)
    assert batch.num_samples == 4
    logged = window.flush()
    assert logged["reward_group_std"] == pytest.approx((3 * 1.0 + 3.0) / 4)  # per sample, not per group (2.0)
    assert logged["rewards/f/group_std"] == pytest.approx((3 * 0.5 + 1.5) / 4)
    assert logged["sample/dropped_stale_count"] == 2


def test_queue_size_counts_samples() -> None:
    window = MetricWindow()
    source = QueueSource([_group(0, 3, 0, 1.0, {}), _group(1, 2, 0, 1.0, {}), _group(2, 4, 0, 1.0, {})])
    stream = MicroBatchStream(source, num_rows=1, token_budget=6, max_staleness=2, metrics=window)
    next(stream)  # rows hold 6 tokens: the first two samples of group 0
    assert window.flush()["rollout/queue_size"] == 9
    next(stream)
    assert window.flush()["rollout/queue_size"] == 7


def test_group_stds_of_a_scored_group() -> None:
    sources = {"f": [1.0, 0.0, None, 1.0], "g": [None, None, None, None]}
    rewards = np.array([1.0, 0.0, np.nan, 1.0])
    std, per_source = group_stds(sources, rewards)
    assert std == pytest.approx(np.std([1.0, 0.0, 1.0]))
    assert per_source == {"f": pytest.approx(np.std([1.0, 0.0, 1.0]))}
    records = RecordBuffer()
    group = RolloutGroup(prompts=[[]] * 4, reward_kwargs={}, completions=[[]] * 4, completions_ids=[[1]] * 4,
                         completions_sequences=[[]] * 4, tool_call_counts=[0] * 4, tool_failure_counts=[0] * 4,
                         policy_version=0, group_id=0, row_index=0, env_rewards=[None] * 4,
                         rollout_rewards=[None] * 4, rewards=rewards)
    record_group_metrics(records, group, sources, dropped=False)
    names = {r[1] for r in records.take()}
    assert "reward_group_std" not in names and "rewards/f/group_std" not in names  # logged as samples train
