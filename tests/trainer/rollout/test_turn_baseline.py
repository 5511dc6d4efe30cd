"""``turn_baseline``: a turn is credited relative to the rollouts of its group that reached the same state."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer.rollout.test_scoring import STUB_TOKENIZER, make_group, stub_settings
from trainer.records import TrainingSample, TrainingSequence
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.scoring import group_advantages
from trainer.rollout.turn_baseline import turn_advantages
from trainer.training.packing import build_row

PROMPT = [1, 2, 3]


def two_turns(call: int, answer: int) -> TrainingSequence:
    """The prompt, a first turn ``[call, 9]``, the tool's result ``[7, call]`` and a final turn ``[answer, 9]``."""
    ids = [*PROMPT, call, 9, 7, call, answer, 9]
    return TrainingSequence(input_ids=ids, loss_mask=[0, 0, 0, 1, 1, 0, 0, 1, 1], sampler_logprobs=[-0.1] * 9)


def test_a_final_turn_is_credited_against_the_rollouts_that_reached_its_state() -> None:
    """Calls 5, 5, 4, 6: the two rollouts that called 5 share the final turn's state; their reward was
    settled by the call, so their final turns get no advantage at all; the others keep theirs."""
    sequences = [[two_turns(5, 50)], [two_turns(5, 51)], [two_turns(4, 40)], [two_turns(6, 60)]]
    advantages = group_advantages(np.array([1.0, 1.0, 0.0, 0.0]))
    per_token, shared, turns = turn_advantages(sequences, advantages, [True] * 4)
    assert per_token[0][0] is not None and per_token[1][0] is not None
    for i in (0, 1):
        assert per_token[i][0][3:5] == pytest.approx([advantages[i]] * 2), "the first turn keeps A_i"
        assert per_token[i][0][7:] == pytest.approx([0.0, 0.0]), "A_i minus the mean over the same state"
    assert per_token[2] == [None] and per_token[3] == [None], "a state no other rollout reached keeps A_i"
    assert (shared, turns) == (4 + 2, 8), "every first turn shares the prompt; two final turns share a state"


def test_the_turns_taken_from_one_state_sum_to_zero() -> None:
    sequences = [[two_turns(5, 50)], [two_turns(5, 51)], [two_turns(5, 52)], [two_turns(6, 60)]]
    advantages = np.array([1.5, -0.5, 0.2, -1.2])  # e.g. a final answer that a reward function grades
    per_token, _, _ = turn_advantages(sequences, advantages, [True] * 4)
    finals = [per_token[i][0][7] for i in range(3)]
    assert sum(finals) == pytest.approx(0.0, abs=1e-12)
    assert finals == pytest.approx([1.5 - 0.4, -0.5 - 0.4, 0.2 - 0.4])
    assert per_token[0][0][3] == pytest.approx(1.5), "the first turn's baseline is the group's mean: 0 here"


def test_rollouts_not_counted_neither_get_nor_give_a_baseline() -> None:
    sequences = [[two_turns(5, 50)], [two_turns(5, 51)], [two_turns(5, 52)]]
    advantages = np.array([1.0, 0.0, 5.0])
    per_token, _, _ = turn_advantages(sequences, advantages, [True, True, False])
    assert per_token[2] == [None]
    assert per_token[0][0][7] == pytest.approx(1.0 - 0.5), "the state's mean is over the two counted rollouts"


def test_a_nonzero_group_mean_is_subtracted_from_the_first_turn_too() -> None:
    """With a loop's own ``compute_advantages`` the first turn is centred on its group (here by 0.5)."""
    sequences = [[two_turns(5, 50)], [two_turns(6, 60)]]
    per_token, _, _ = turn_advantages(sequences, np.array([1.0, 0.0]), [True, True])
    assert per_token[0][0][3:5] == pytest.approx([0.5, 0.5]) and per_token[1][0][3:5] == pytest.approx([-0.5, -0.5])


def test_token_advantages_reach_the_packed_row() -> None:
    seq = two_turns(5, 50)
    values = [0.0] * 3 + [2.0, 2.0] + [0.0] * 2 + [-1.0, -1.0]
    row = build_row([TrainingSample(seq, advantage=2.0, group_id=0, policy_version=0, token_advantages=values)])
    assert row.advantages.tolist() == [2.0, 2.0, -1.0, -1.0]


@pytest.mark.parametrize("turn_baseline", [True, False])
def test_the_loop_credits_turns_against_shared_states(turn_baseline: bool) -> None:
    loop = AsyncRolloutLoop(stub_settings(mask_truncated_completions=False, turn_baseline=turn_baseline),
                            STUB_TOKENIZER)
    group = make_group(3)
    group.rollout_rewards = [1.0, 1.0, 0.0]
    group.completions_sequences = [[two_turns(5, 50)], [two_turns(5, 51)], [two_turns(4, 40)]]
    try:
        queued = loop.scheduler.score(group, [], position=0)
    finally:
        loop.executor.shutdown()
    rows = [build_row([s]).advantages.tolist() for s in queued.samples]
    a = group_advantages(np.array([1.0, 1.0, 0.0]))
    finals = [0.0, 0.0, a[2]] if turn_baseline else list(a)
    assert rows == [pytest.approx([a[i], a[i], finals[i], finals[i]]) for i in range(3)]
    assert [s.advantage for s in queued.samples] == pytest.approx(a), "the rollout's own advantage is kept"
    logged = [name for _, name, _, _ in loop.records.take()]
    assert ("rollout/turn_baseline_frac" in logged) == turn_baseline
