"""Per-rollout and per-group metrics recorded by the rollout worker (names as in TRL's AsyncGRPOTrainer).

Recorded when the worker scores a group, not when its samples train, so they include groups that
are later dropped (all rewards equal, or stale). The group standard deviations are the exception:
:func:`group_stds` computes them here, they travel with the group's samples and are logged as each
sample trains (``reward_group_std``, ``rewards/{name}/group_std``: averaged over trained samples).
"""

from __future__ import annotations

import numpy as np

from trainer.metrics import RecordBuffer
from trainer.records import Rollout, RolloutGroup, TrainingSequence
from trainer.rollout.reconcile import ReconcileStats


def record_rollout_metrics(
    records: RecordBuffer, rollout: Rollout, sequences: list[TrainingSequence], stats: ReconcileStats,
    eos_token_ids: list[int],
) -> None:
    """``completions/*`` lengths, ``rollout/turns_*``, samples per rollout, forks and drift, tool calls."""
    length = len(rollout.completion_ids)  # generated tokens only: tool results are not counted
    terminated = not rollout.truncated(eos_token_ids)
    for stat in ("mean_length", "min_length", "max_length"):
        records.add(f"completions/{stat}", length)
    if terminated:
        for stat in ("mean_terminated_length", "min_terminated_length", "max_terminated_length"):
            records.add(f"completions/{stat}", length)
    records.add("completions/clipped_ratio", float(not terminated))
    records.add("rollout/turns_mean", len(rollout.turns))
    records.add("rollout/turns_max", len(rollout.turns))
    records.add("rollout/samples_per_rollout", len(sequences))
    if stats.transitions:
        records.add_rate("rollout/fork_frac", stats.forks, stats.transitions)
        for drift in stats.drift_tokens:
            records.add("rollout/drift_tokens_mean", drift)
            records.add("rollout/drift_tokens_max", drift)
    for seq in sequences:
        records.add("sample/forwarded_tokens_mean", len(seq.input_ids))
        records.add("sample/forwarded_tokens_max", len(seq.input_ids))
        records.add("sample/trained_tokens_mean", seq.num_trained)


def duplicate_fraction(rollouts_tokens: list[tuple[int, ...]]) -> float:
    """Fraction of rollouts that repeat an earlier rollout of their group token for token."""
    seen: set[tuple[int, ...]] = set()
    duplicates = 0
    for tokens in rollouts_tokens:
        duplicates += tokens in seen
        seen.add(tokens)
    return duplicates / len(rollouts_tokens) if rollouts_tokens else 0.0


def group_stds(sources: dict[str, list[float | None]], rewards: np.ndarray) -> tuple[float, dict[str, float]]:
    """The group's standard deviation of the summed rewards over its scorable rollouts (the advantages'
    divisor) and, per reward source, of the values it returned."""
    per_source = {name: float(np.std([v for v in values if v is not None]))
                  for name, values in sources.items() if any(v is not None for v in values)}
    scorable = rewards[~np.isnan(rewards)]
    return (float(scorable.std()) if scorable.size else 0.0), per_source


def record_group_metrics(
    records: RecordBuffer, group: RolloutGroup, sources: dict[str, list[float | None]], dropped: bool
) -> None:
    """``rewards/{name}/mean``, ``reward``, ``frac_zero_std_groups``, ``reward_zero_std_groups``,
    ``completions/duplicate_frac``."""
    assert group.rewards is not None
    rewards = group.rewards
    scorable = rewards[~np.isnan(rewards)]
    for name, values in sources.items():
        for v in values:
            if v is not None:
                records.add(f"rewards/{name}/mean", v)
    for r in scorable:
        records.add("reward", float(r))
    records.add("frac_zero_std_groups", float(dropped))
    if dropped and scorable.size:
        records.add("reward_zero_std_groups", float(scorable.mean()))
    tokens = [tuple(ids) for ids in group.completions_ids]  # every turn's generated tokens
    records.add("completions/duplicate_frac", duplicate_fraction(tokens))
