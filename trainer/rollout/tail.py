"""Train a rollout up to its first tail token, not after it (``tail_token_prob``, ``docs/loss.md``).

A *tail token* is one the sampler drew although it gave it less than ``tail_token_prob`` times the
probability of the position's most likely token (vLLM's ``min_p`` rule, applied after sampling).
A rollout that samples one usually derails into text unlike anything the policy was trained on (a
malformed tool call and the tool's error message, a fragment repeated until the token limit), and the
policy's gradient on the tokens it writes there is orders of magnitude larger than on its usual
tokens: in the counter run of ``bench/e2e/README.md`` one such rollout carried 81 % of a step's
gradient and that step turned the policy's final answer into a tool-call fragment. So the tail token
itself is trained with the rollout's advantage (the policy still learns whether taking it paid off),
and every later token of the rollout stays in its sequence as context only.
"""

from __future__ import annotations

import dataclasses
import math

from trainer.records import TrainingSequence

__all__ = ["first_tail_position", "train_until_tail"]


def _is_tail(logq: float, top: dict[int, float] | None, log_ratio: float) -> bool:
    """Whether a token sampled at log-probability ``logq`` lies below ``log_ratio`` + the top log-prob."""
    best = max(top.values(), default=logq) if top else 0.0  # no top-k: compare with probability 1
    return logq - max(best, logq) < log_ratio


def first_tail_position(sequence: TrainingSequence, tail_token_prob: float) -> int | None:
    """Index in ``sequence`` of its first trained tail token, ``None`` when it has none."""
    log_ratio = math.log(tail_token_prob)
    tops = sequence.sampler_top_logprobs
    for i, trained in enumerate(sequence.loss_mask):
        if trained and _is_tail(sequence.sampler_logprobs[i], tops[i] if tops else None, log_ratio):
            return i
    return None


def train_until_tail(sequences: list[TrainingSequence],
                     tail_token_prob: float | None) -> tuple[list[TrainingSequence], int]:
    """One rollout's sequences (in order) with every token after its first tail token left untrained.

    Args:
        sequences: The rollout's training sequences, in the order their turns were generated.
        tail_token_prob: The tail bound relative to the position's most likely token; ``None`` or 0
            trains every token.

    Returns:
        The sequences that still have a trained token, and how many tokens were left untrained.
    """
    if not tail_token_prob:
        return sequences, 0
    out: list[TrainingSequence] = []
    untrained = 0
    tail_seen = False
    for seq in sequences:
        start = 0 if tail_seen else first_tail_position(seq, tail_token_prob)
        if start is None:
            out.append(seq)
            continue
        cut = start if tail_seen else start + 1  # the tail token itself keeps its advantage
        tail_seen = True
        mask = list(seq.loss_mask)
        untrained += sum(mask[cut:])
        mask[cut:] = [0] * (len(mask) - cut)
        if any(mask):
            out.append(dataclasses.replace(seq, loss_mask=mask))
    return out, untrained
