"""``tail_token_prob``: a rollout is trained up to and including its first tail token, not after it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.rollout.test_scoring import _scoring_loop, make_group
from trainer.records import TrainingSequence
from trainer.rollout.tail import first_tail_position, train_until_tail

LIKELY = math.log(0.9)
RARE = math.log(1e-5)


def sequence(logqs: list[float], tops: list[dict[int, float] | None] | None = None,
             context: int = 2) -> TrainingSequence:
    """``context`` untrained tokens, then one trained token per log-probability."""
    n = len(logqs)
    return TrainingSequence(
        input_ids=list(range(context + n)), loss_mask=[0] * context + [1] * n,
        sampler_logprobs=[0.0] * context + logqs,
        sampler_top_logprobs=None if tops is None else [None] * context + tops)


def test_a_rollout_without_a_tail_token_is_trained_whole() -> None:
    seqs = [sequence([LIKELY, math.log(0.05), LIKELY])]
    out, untrained = train_until_tail(seqs, 1e-3)
    assert out == seqs and untrained == 0


def test_tokens_after_the_first_tail_token_are_context_only() -> None:
    seq = sequence([LIKELY, RARE, LIKELY, RARE, LIKELY])
    [out], untrained = train_until_tail([seq], 1e-3)
    assert out.loss_mask == [0, 0, 1, 1, 0, 0, 0], "the tail token itself keeps its advantage"
    assert out.input_ids == seq.input_ids and out.sampler_logprobs == seq.sampler_logprobs
    assert untrained == 3
    assert seq.loss_mask == [0, 0, 1, 1, 1, 1, 1], "the input sequence is left as it was"


def test_later_sequences_of_the_rollout_are_cut_too() -> None:
    """A fork starts a new sequence; after a tail token in an earlier one, nothing later is trained."""
    first, second = sequence([RARE, LIKELY]), sequence([LIKELY, LIKELY], context=5)
    out, untrained = train_until_tail([first, second], 1e-3)
    assert [s.loss_mask for s in out] == [[0, 0, 1, 0]], "a sequence left with nothing to train is dropped"
    assert untrained == 3


def test_the_bound_is_relative_to_the_most_likely_token() -> None:
    """vLLM's min_p rule: at a flat position a 1e-4 token is ordinary, at a confident one it is the tail."""
    flat = {1: math.log(2e-4), 2: math.log(1.5e-4)}
    confident = {1: LIKELY, 2: math.log(0.05)}
    rare = math.log(1e-4)
    assert first_tail_position(sequence([rare], [flat]), 1e-3) is None
    assert first_tail_position(sequence([rare], [confident]), 1e-3) == 2
    assert first_tail_position(sequence([rare]), 1e-3) == 2, "without top log-probs: relative to probability 1"
    assert first_tail_position(sequence([rare]), 1e-5) is None


@pytest.mark.parametrize("tail_token_prob", [None, 0.0])
def test_none_or_zero_trains_every_token(tail_token_prob: float | None) -> None:
    seqs = [sequence([RARE, RARE])]
    assert train_until_tail(seqs, tail_token_prob) == (seqs, 0)


def test_the_loop_trains_each_rollout_until_its_tail_and_logs_how_many(tmp_path: Path) -> None:
    loop = _scoring_loop(tmp_path, mask=False)
    group = make_group(2)
    group.rollout_rewards = [1.0, 0.0]
    group.completions_sequences = [[sequence([LIKELY, RARE, LIKELY])], [sequence([LIKELY, LIKELY, LIKELY])]]
    try:
        queued = loop.scheduler.score(group, [], position=0)
    finally:
        loop.executor.shutdown()
    assert [s.sequence.loss_mask for s in queued.samples] == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert queued.tokens == 10, "untrained tokens are still forwarded as context"
    rates: dict[str, list[float]] = {}
    for _, name, num, den in loop.records.take():
        if name.startswith("rollout/tail"):
            total = rates.setdefault(name, [0.0, 0.0])
            total[0] += num
            total[1] += den
    assert rates == {"rollout/tail_truncated_frac": [1, 2], "rollout/tail_untrained_frac": [1, 6]}
    np.testing.assert_allclose([s.advantage for s in queued.samples], [1.0, -1.0], atol=1e-3)
