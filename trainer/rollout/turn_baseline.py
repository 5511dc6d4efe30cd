"""Credit each turn relative to the rollouts of its group that reached the same state (``turn_baseline``).

GRPO gives every token of a rollout the rollout's advantage ``A_i``, so a multi-turn rollout's later
turns are credited with what its earlier turns did: in the counter task the final turn, written
after the tool has answered and the reward is settled, gets the advantage of the first call's step,
and whatever it writes (``The counter is now 4.`` or a fragment such as ``{"step": 4}}</tool_call>``)
is reinforced when that call was right and pushed down when it was wrong: noise with the size of
the real signal, which drifted the demo's final answers into call fragments until they corrupted
the calls themselves (``bench/e2e/README.md``).

Here a turn's *state* is everything before its first generated token (prompt, earlier turns, tool
results), as a token sequence. When several rollouts of the group reached the state of a turn, the
turn's tokens get ``A_i - mean_{j in S} A_j`` over those rollouts ``S`` (a state-dependent baseline
estimated from the group itself, no critic): what was already decided when the turn began is
subtracted, and the advantages of the turns taken from one state sum to zero. A turn whose state
no other rollout reached keeps ``A_i``, as does the first turn of rollouts that share their prompt
(with GRPO's advantages the group's mean is 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainer.records import TrainingSequence

__all__ = ["turn_advantages"]

_NEGLIGIBLE = 1e-9  # a baseline this small is float rounding of a zero mean (GRPO's first turn)


def _turn_starts(sequence: TrainingSequence) -> list[int]:
    """Where each run of trained tokens begins: a turn's first generated token."""
    mask = sequence.loss_mask
    return [i for i, trained in enumerate(mask) if trained and (i == 0 or not mask[i - 1])]


def turn_advantages(sequences: Sequence[Sequence[TrainingSequence]], advantages: Sequence[float],
                    counted: Sequence[bool]) -> tuple[list[list[list[float] | None]], int, int]:
    """Per-token advantages of a group's rollouts under the turn baseline.

    Args:
        sequences: Per rollout, its training sequences.
        advantages: Per rollout, its advantage ``A_i``.
        counted: Per rollout, whether it is trained with a scored reward (a masked or unscorable
            rollout neither gets nor gives a baseline).

    Returns:
        Per rollout, per sequence: one advantage per token (only the trained positions matter), or
        ``None`` where every trained token keeps ``A_i``; then how many turns were credited against a
        shared state, and how many turns there were.
    """
    reached: dict[tuple[int, ...], set[int]] = {}
    for i, seqs in enumerate(sequences):
        if counted[i]:
            for seq in seqs:
                for start in _turn_starts(seq):
                    reached.setdefault(tuple(seq.input_ids[:start]), set()).add(i)
    out: list[list[list[float] | None]] = []
    shared = turns = 0
    for i, seqs in enumerate(sequences):
        per_seq: list[list[float] | None] = []
        for seq in seqs:
            if not counted[i]:
                per_seq.append(None)
                continue
            values = np.full(len(seq.input_ids), float(advantages[i]))
            starts = _turn_starts(seq)
            turns += len(starts)
            changed = False
            for start, end in zip(starts, [*starts[1:], len(seq.input_ids)], strict=True):
                others = reached[tuple(seq.input_ids[:start])]
                if len(others) > 1:
                    shared += 1
                    baseline = float(np.mean([advantages[j] for j in others]))
                    if abs(baseline) > _NEGLIGIBLE:
                        values[start:end] -= baseline
                        changed = True
            per_seq.append(values.tolist() if changed else None)
        out.append(per_seq)
    return out, shared, turns
