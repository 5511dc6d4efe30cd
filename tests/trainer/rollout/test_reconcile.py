"""Reconciliation of a rollout's turns into training sequences (docs/multiturn.md)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from trainer.records import TurnRecord
from trainer.rollout.reconcile import reconcile_turns


def lp(ids: list[int]) -> list[float]:
    """A distinct sampler log-prob per generated token, so misplaced values are caught."""
    return [-i / 1000 for i in ids]


def turn(prompt: list[int], output: list[int], mask: list[int] | None = None, **kw) -> TurnRecord:
    return TurnRecord(prompt_ids=prompt, output_ids=output, output_log_probs=lp(output), output_mask=mask, **kw)


def layout(seq) -> tuple[list[int], list[int]]:
    return seq.input_ids, seq.loss_mask


# Each case: turns, expected (input_ids, loss_mask) per sequence, forks, drift per transition.
CASES = {
    "single_turn": (
        [turn([1, 2, 3], [10, 11, 12])],
        [([1, 2, 3, 10, 11, 12], [0, 0, 0, 1, 1, 1])],
        0, [],
    ),
    "extension_with_tool_result": (
        [turn([1, 2], [10, 11]), turn([1, 2, 10, 11, 7, 8], [12])],
        [([1, 2, 10, 11, 7, 8, 12], [0, 0, 1, 1, 0, 0, 1])],
        0, [0],
    ),
    "three_turn_extension": (
        [turn([1], [10]), turn([1, 10, 7], [11, 12]), turn([1, 10, 7, 11, 12, 8, 9], [13])],
        [([1, 10, 7, 11, 12, 8, 9, 13], [0, 1, 0, 1, 1, 0, 0, 1])],
        0, [0, 0],
    ),
    "extension_with_no_new_context": (
        [turn([1, 2], [10]), turn([1, 2, 10], [11])],
        [([1, 2, 10, 11], [0, 0, 1, 1])],
        0, [0],
    ),
    "fork_after_rerender": (
        # The template dropped the first answer (10, 11) from history: held [1 2 10 11] vs [1 2 7 8].
        [turn([1, 2], [10, 11]), turn([1, 2, 7, 8], [12])],
        [([1, 2, 10, 11], [0, 0, 1, 1]), ([1, 2, 7, 8, 12], [0, 0, 0, 0, 1])],
        1, [2],
    ),
    "fork_diverging_at_first_token": (
        [turn([1, 2], [10]), turn([5, 2, 10, 7], [11])],
        [([1, 2, 10], [0, 0, 1]), ([5, 2, 10, 7, 11], [0, 0, 0, 0, 1])],
        1, [3],
    ),
    "fork_with_shorter_prompt": (
        # A prompt that is a strict prefix of the held tokens does not start with them: fork.
        [turn([1, 2, 3], [10, 11]), turn([1, 2, 3, 10], [12])],
        [([1, 2, 3, 10, 11], [0, 0, 0, 1, 1]), ([1, 2, 3, 10, 12], [0, 0, 0, 0, 1])],
        1, [1],
    ),
    "fork_then_extension": (
        [turn([1], [10, 11]), turn([1, 9], [12]), turn([1, 9, 12, 8], [13])],
        [([1, 10, 11], [0, 1, 1]), ([1, 9, 12, 8, 13], [0, 0, 1, 0, 1])],
        1, [2, 0],
    ),
    "several_forks": (
        [turn([1], [10]), turn([1, 7], [11]), turn([1, 7, 11, 8], [12]), turn([1, 6], [13, 14])],
        [([1, 10], [0, 1]), ([1, 7, 11, 8, 12], [0, 0, 1, 0, 1]), ([1, 6, 13, 14], [0, 0, 1, 1])],
        2, [1, 0, 4],
    ),
    "output_mask_zeros": (
        [turn([1, 2], [10, 11, 12], mask=[1, 0, 1]), turn([1, 2, 10, 11, 12, 7], [13, 14], mask=[0, 1])],
        [([1, 2, 10, 11, 12, 7, 13, 14], [0, 0, 1, 0, 1, 0, 0, 1])],
        0, [0],
    ),
    "fully_masked_turn_keeps_context": (
        [turn([1], [10], mask=[0]), turn([1, 10, 7], [11])],
        [([1, 10, 7, 11], [0, 0, 0, 1])],
        0, [0],
    ),
    "untrained_sequence_before_fork_is_dropped": (
        [turn([1], [10], mask=[0]), turn([2], [11])],
        [([2, 11], [0, 1])],
        1, [2],
    ),
    "nothing_trained": (
        [turn([1], [10, 11], mask=[0, 0])],
        [],
        0, [],
    ),
    "no_turns": ([], [], 0, []),
}


@pytest.mark.parametrize(("turns", "expected", "forks", "drift"), CASES.values(), ids=CASES.keys())
def test_reconcile_table(turns, expected, forks, drift):
    sequences, stats = reconcile_turns(turns)
    assert [layout(s) for s in sequences] == expected
    assert stats.transitions == max(len(turns) - 1, 0)
    assert stats.forks == forks
    assert stats.drift_tokens == drift
    for seq in sequences:  # sampler log-probs sit on trained/generated tokens, 0 on context
        for tok, m, logq in zip(seq.input_ids, seq.loss_mask, seq.sampler_logprobs, strict=True):
            if m:
                assert logq == -tok / 1000
            elif tok < 10:
                assert logq == 0.0


def test_sampler_top_logprobs_and_candidates_follow_generated_tokens():
    tops = [{10: -0.1, 99: -2.0}, {11: -0.2}]
    turns = [
        TurnRecord([1, 2], [10, 11], [-0.1, -0.2], output_sampler_logprobs=tops,
                   output_sampling_mask=[[10, 99], [11, 5]]),
        TurnRecord([1, 2, 10, 11, 7], [12], [-0.3]),
    ]
    (seq,), _ = reconcile_turns(turns)
    assert seq.sampler_top_logprobs == [None, None, tops[0], tops[1], None, None]
    assert seq.sampling_masks == [None, None, [10, 99], [11, 5], None, None]
    assert seq.sampler_logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, -0.3]


def test_no_candidate_sets_gives_none():
    (seq,), _ = reconcile_turns([turn([1], [10, 11])])
    assert seq.sampling_masks is None
    assert seq.sampler_top_logprobs == [None, None, None]


@pytest.mark.parametrize("turns", [
    [TurnRecord([1, 2], [10, 11])],                                     # trained, no log-probs
    [turn([1], [10]), TurnRecord([1, 10, 7], [11, 12], output_mask=[0, 1])],
    [turn([1], [10]), TurnRecord([5], [11])],                           # after a fork
])
def test_missing_log_probs_for_trained_tokens_raises(turns):
    with pytest.raises(ValueError, match="needs output_log_probs"):
        reconcile_turns(turns)


def test_missing_log_probs_allowed_when_nothing_is_trained():
    turns = [TurnRecord([1], [10, 11], output_mask=[0, 0]), turn([1, 10, 11, 7], [12])]
    (seq,), _ = reconcile_turns(turns)
    assert seq.loss_mask == [0, 0, 0, 0, 1]
    assert seq.sampler_logprobs == [0.0, 0.0, 0.0, 0.0, -0.012]


def test_log_prob_count_mismatch_raises():
    with pytest.raises(ValueError, match="3 output tokens but 2 log-probs"):
        reconcile_turns([TurnRecord([1], [10, 11, 12], [-0.1, -0.2])])


# --- every generated token trained in exactly one sequence, over random rollouts ---------------

def random_rollout(rng: random.Random) -> tuple[list[TurnRecord], list[int], list[int]]:
    """Random turns; generated ids (>= 1000) and context ids (< 1000) are all distinct.

    Returns the turns, the drift each transition must report, and the generated ids with mask 1.
    """
    ctx = iter(range(1, 1000))
    gen = iter(range(1000, 10**6))
    turns: list[TurnRecord] = []
    drift: list[int] = []
    trained: list[int] = []
    held = [next(ctx) for _ in range(rng.randint(1, 4))]
    prompt = list(held)
    for t in range(rng.randint(1, 6)):
        if t:
            if rng.random() < 0.5:  # extension: everything held, then tool output / template glue
                prompt = held + [next(ctx) for _ in range(rng.randint(0, 3))]
                drift.append(0)
            else:  # re-render: keep k held tokens, then a token that was never held
                k = rng.randint(0, len(held) - 1)
                prompt = held[:k] + [next(ctx)] + rng.sample(held, min(2, len(held)))
                drift.append(len(held) - k)
            held = list(prompt)
        output = [next(gen) for _ in range(rng.randint(1, 4))]
        mask = [int(rng.random() < 0.8) for _ in output]
        log_probs = lp(output) if any(mask) or rng.random() < 0.5 else []
        turns.append(TurnRecord(list(prompt), output, log_probs, output_mask=mask))
        trained += [tok for tok, m in zip(output, mask, strict=True) if m]
        held = held + output
    return turns, drift, trained


@pytest.mark.parametrize("seed", range(40))
def test_every_generated_token_trained_exactly_once(seed):
    turns, drift, trained = random_rollout(random.Random(seed))
    sequences, stats = reconcile_turns(turns)

    trained_positions = Counter(
        tok for seq in sequences for tok, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m
    )
    assert trained_positions == Counter(trained)  # each trained generated token exactly once, nothing else
    assert stats.drift_tokens == drift
    assert stats.forks == sum(d > 0 for d in drift)
    assert stats.transitions == len(turns) - 1
    assert all(seq.num_trained > 0 and seq.loss_mask[0] == 0 for seq in sequences)
    for seq in sequences:
        for tok, m, logq in zip(seq.input_ids, seq.loss_mask, seq.sampler_logprobs, strict=True):
            if m:
                assert logq == -tok / 1000
            if tok < 1000:
                assert m == 0 and logq == 0.0  # context is never trained
    # A trained turn is trained after exactly its own prompt: one sequence starts with prompt + output,
    # the output's mask in place.
    for t in turns:
        if any(t.output_mask):
            n, history = len(t.prompt_ids), t.prompt_ids + t.output_ids
            assert sum(
                seq.input_ids[: len(history)] == history and seq.loss_mask[n: len(history)] == t.output_mask
                for seq in sequences
            ) == 1
