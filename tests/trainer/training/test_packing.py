"""Tree packing: the trie layout (the worked example of docs/packing.md, random invariants) and the row planner."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.records import TrainingSample, TrainingSequence
from trainer.training.packing import (
    OversizeSampleError,
    PackedRow,
    RowPlanner,
    batch_metrics,
    build_row,
)

P1, P2, P3, A1, A2, B1, B2 = 101, 102, 103, 201, 202, 301, 302


def make_sample(ids: list[int], prompt_len: int, group: int = 0, advantage: float = 1.0) -> TrainingSample:
    """A sample whose tokens after ``prompt_len`` are trained, with log q = -(token id) / 1000."""
    mask = [0] * prompt_len + [1] * (len(ids) - prompt_len)
    logq = [-t / 1000 if m else 0.0 for t, m in zip(ids, mask, strict=True)]
    return TrainingSample(TrainingSequence(ids, mask, logq), advantage, group, policy_version=0)


def two_rollouts() -> list[TrainingSample]:
    return [make_sample([P1, P2, P3, A1, A2], 3), make_sample([P1, P2, P3, B1, B2], 3, advantage=-1.0)]


def test_source_example_packs_to_eight_tokens() -> None:
    row = build_row(two_rollouts())
    assert row.input_ids.tolist() == [P1, P2, P3, A1, A2, P3, B1, B2]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert row.segment_ids.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]  # S0 | S1 | S2
    assert row.pred_index.tolist() == [2, 3, 5, 6]  # a1 a2 at 2 3, b1 b2 at 5 6
    assert row.target_ids.tolist() == [A1, A2, B1, B2]
    assert row.advantages.tolist() == [1.0, 1.0, -1.0, -1.0]
    assert row.token_sample.tolist() == [0, 0, 1, 1]
    assert (row.num_unpacked_tokens, row.num_unique_tokens, row.num_samples) == (10, 8, 2)
    # S2's keys: p1 p2 (index 0 1) and itself (5 6 7), never S1.
    visible = (row.dfs_enter[None, :] <= row.dfs_enter[:, None]) & (row.dfs_enter[:, None] < row.dfs_leave[None, :])
    assert visible[7].nonzero().flatten().tolist() == [0, 1, 5, 6, 7]
    assert visible[4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert row.attention_cost == int(visible.sum())


def test_without_sharing_each_sample_is_a_segment() -> None:
    row = build_row(two_rollouts(), share_prefixes=False)
    assert row.input_ids.tolist() == [P1, P2, P3, A1, A2, P1, P2, P3, B1, B2]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert row.segment_ids.tolist() == [0] * 5 + [1] * 5
    assert row.pred_index.tolist() == [2, 3, 7, 8]


def test_top_logprobs_and_candidate_sets_are_padded_per_token() -> None:
    seq = TrainingSequence(
        [1, 2, 3, 4],
        [0, 1, 0, 1],
        [0.0, -0.1, 0.0, -0.4],
        sampler_top_logprobs=[None, {2: -0.1, 7: -2.5}, None, {4: -0.4}],
        sampling_masks=[None, [2, 7, 9], None, None],
    )
    row = build_row([TrainingSample(seq, 0.5, group_id=3, policy_version=1)])
    assert row.sampler_topk_ids.tolist() == [[2, 7], [4, 0]]
    assert row.sampler_topk_valid.tolist() == [[True, True], [True, False]]
    assert torch.allclose(row.sampler_topk_logprobs, torch.tensor([[-0.1, -2.5], [-0.4, 0.0]]))
    assert row.candidate_ids.tolist() == [[2, 7, 9], [0, 0, 0]]
    assert row.candidate_valid.tolist() == [[True, True, True], [False, False, False]]
    assert build_row(two_rollouts()).candidate_ids is None


def test_select_trained_slices_every_per_token_column() -> None:
    row = build_row(two_rollouts())  # trained: A1 A2 | B1 B2
    part = row.select_trained(slice(1, 3))
    assert part.target_ids.tolist() == [A2, B1] and part.num_trained == 2
    assert part.pred_index.tolist() == row.pred_index[1:3].tolist()  # still row positions
    assert part.advantages.tolist() == [1.0, -1.0] and part.token_sample.tolist() == [0, 1]
    assert part.sampler_logprobs.tolist() == row.sampler_logprobs[1:3].tolist()
    assert part.sampler_topk_ids.shape == (2, 0) and part.candidate_ids is None
    assert torch.equal(part.input_ids, row.input_ids) and part.sample_group_ids == row.sample_group_ids


def test_empty_row_and_device_move() -> None:
    row = PackedRow.empty(pad_token_id=7)
    assert row.input_ids.tolist() == [7] and row.num_trained == 0 and row.num_samples == 0
    moved = build_row(two_rollouts()).to("cpu")
    assert moved.input_ids.tolist() == [P1, P2, P3, A1, A2, P3, B1, B2]
    assert build_row([]).num_unique_tokens == 0


group_strategy = st.tuples(
    st.lists(st.integers(0, 3), min_size=1, max_size=6),  # prompt
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=4),  # completions
)


def group_samples(groups: list[tuple[list[int], list[list[int]]]]) -> list[TrainingSample]:
    return [
        make_sample(prompt + completion, len(prompt), group=g)
        for g, (prompt, completions) in enumerate(groups)
        for completion in completions
    ]


@settings(max_examples=60, deadline=None)
@given(st.lists(group_strategy, min_size=1, max_size=4), st.booleans())
def test_every_trained_token_sees_exactly_its_own_history(groups, share: bool) -> None:
    samples = group_samples(groups)
    row = build_row(samples, share_prefixes=share)
    enter, leave = row.dfs_enter, row.dfs_leave
    for t in range(row.num_trained):
        q = int(row.pred_index[t])
        history = ((enter <= enter[q]) & (enter[q] < leave)).nonzero().flatten()  # ancestors of q and q
        ids = samples[int(row.token_sample[t])].sequence.input_ids
        depth = int(row.position_ids[q])
        assert row.position_ids[history].tolist() == list(range(depth + 1))
        assert row.input_ids[history].tolist() == ids[: depth + 1]
        assert int(row.target_ids[t]) == ids[depth + 1]
    # Minimal trie: one node per distinct (prefix, next token) among the samples.
    keys = {
        (tuple(s.sequence.input_ids[: i + 1]), tuple(s.sequence.input_ids[i + 1 : i + 2]), k if not share else 0)
        for k, s in enumerate(samples)
        for i in range(len(s.sequence.input_ids))
    }
    assert row.num_unique_tokens == row.input_ids.numel() == len(keys)
    assert row.attention_cost == int((row.position_ids + 1).sum())
    assert row.num_trained == sum(s.sequence.num_trained for s in samples)


def test_planner_keeps_groups_together_and_spreads_them_over_processes() -> None:
    planner = RowPlanner(num_rows=2, token_budget=100)
    a = [make_sample([1, 2, 3, 4, 10 + i], 4, group=0) for i in range(3)]
    b = [make_sample([5, 6, 7, 8, 20 + i], 4, group=1) for i in range(3)]
    for s in [a[0], b[0], a[1], b[1], a[2], b[2]]:
        assert planner.add(s)
    rows = planner.rows()
    assert [r.sample_group_ids for r in rows] == [(0, 0, 0), (1, 1, 1)]
    assert [r.num_unique_tokens for r in rows] == [9, 9]  # 1 2 3 shared; 4 predicts a different token each


def test_planner_gives_every_process_a_row() -> None:
    planner = RowPlanner(num_rows=3, token_budget=100)
    for i in range(4):
        assert planner.add(make_sample([1, 2, 3, 10 + i], 3, group=0))
    rows = planner.rows()
    assert all(r.num_samples >= 1 for r in rows)
    assert sum(r.num_samples for r in rows) == 4


def test_planner_closes_the_micro_batch_when_full_and_reopens() -> None:
    planner = RowPlanner(num_rows=1, token_budget=10)
    assert planner.add(make_sample([1, 2, 3, 4], 2, group=0))
    assert planner.add(make_sample([1, 2, 3, 5], 2, group=0))  # shares 1 2: +2 tokens -> 6
    assert not planner.add(make_sample([9, 9, 9, 9, 9], 2, group=1))  # 11 > 10: closes
    assert not planner.add(make_sample([1, 2], 1, group=0))  # closed, even though it would fit
    (row,) = planner.rows()
    assert (row.num_samples, row.num_unique_tokens) == (2, 6)
    assert planner.add(make_sample([9, 9, 9, 9, 9], 2, group=1))


def test_oversize_sample_is_rejected_distinctly() -> None:
    planner = RowPlanner(num_rows=2, token_budget=4)
    with pytest.raises(OversizeSampleError, match="token_budget=4") as info:
        planner.add(make_sample([1, 2, 3, 4, 5], 2))
    assert info.value.sample.num_tokens == 5
    assert planner.num_samples == 0 and not planner.closed


def test_planner_spills_a_full_group_only_without_raising_the_max_cost() -> None:
    def planner_with_two_rows() -> RowPlanner:
        planner = RowPlanner(num_rows=2, token_budget=10)
        assert planner.add(make_sample(list(range(8)), 4, group=0))  # row 0: 8 tokens, cost 36
        assert planner.add(make_sample([50, 51], 1, group=1))  # a new group takes the empty row 1: cost 3
        return planner

    cheap = make_sample([0, 1, 2, 3, 60, 61], 4, group=0)  # row 0 would hold 8 + 3 tokens: full
    planner = planner_with_two_rows()
    assert planner.add(cheap)  # spills to row 1: cost 3 + 21 <= 36
    assert planner.rows()[1].sample_group_ids == (1, 0)
    costly = [0, 1, 2, 3, 70, 71, 72, 73]
    planner = planner_with_two_rows()
    assert not planner.add(make_sample(costly, 4, group=0))  # row 1 would cost 39 > 36: close
    planner = planner_with_two_rows()
    assert planner.add(make_sample(costly, 4, group=2))  # a new group goes where it fits
    assert planner.rows()[1].sample_group_ids == (1, 2)


def test_batch_metrics_of_the_source_example() -> None:
    rows = [build_row(two_rollouts()), PackedRow.empty()]
    m = batch_metrics(rows, token_budget=16)
    assert m["batch/samples_per_row"] == 1.0
    assert m["batch/row_tokens_mean"] == 4.0 and m["batch/row_tokens_max"] == 8.0
    assert m["batch/row_fill_frac"] == 8 / 32
    assert m["batch/row_imbalance"] == 2.0
    assert m["batch/packing_ratio"] == 10 / 8
    assert m["batch/pad_frac"] == 0.5
    assert m["batch/masked_token_frac"] == 6 / 10
    assert (m["batch/forwarded_tokens_per_step"], m["batch/trained_tokens_per_step"]) == (8.0, 4.0)
    assert m["batch/samples_per_step"] == 2.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(group_strategy, min_size=1, max_size=6),
    st.integers(1, 4),
    st.integers(4, 30),
    st.booleans(),
)
def test_planner_invariants(groups, num_rows: int, budget: int, share: bool) -> None:
    samples = group_samples(groups)
    planner = RowPlanner(num_rows, budget, share_prefixes=share)
    placed_at, refused_at, oversize = [], [], []
    for i, s in enumerate(samples):
        try:
            (placed_at if planner.add(s) else refused_at).append(i)
        except OversizeSampleError:
            oversize.append(s)
    placed = [samples[i] for i in placed_at]
    assert all(s.num_tokens > budget for s in oversize)
    assert all(samples[i].num_tokens <= budget for i in placed_at + refused_at)
    if refused_at:  # closed at the first refusal: nothing is placed after it
        assert planner.closed and max(placed_at, default=-1) < refused_at[0]
    rows = planner.rows()
    assert len(rows) == num_rows
    assert all(r.num_unique_tokens <= budget for r in rows)
    assert sum(r.num_samples for r in rows) == len(placed)
    assert sorted(g for r in rows for g in r.sample_group_ids) == sorted(s.group_id for s in placed)
    assert sum(r.num_trained for r in rows) == sum(s.sequence.num_trained for s in placed)
    if len(placed) >= num_rows:
        assert all(r.num_samples > 0 for r in rows)
    assert not planner.closed and planner.num_samples == 0
    metrics = batch_metrics(rows, budget)
    assert 0.0 <= metrics["batch/row_fill_frac"] <= 1.0
    assert metrics["batch/packing_ratio"] >= 1.0 or not placed
    assert metrics["batch/row_imbalance"] >= 1.0
