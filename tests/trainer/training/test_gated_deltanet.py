"""Gated DeltaNet hybrids on tree-packed rows: each sample's log-probs and gradients equal a stock forward of it."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

from tests.trainer.training.test_tree_attention import (
    SMALL,
    VOCAB,
    assert_packed_matches_alone,
    random_groups,
    random_sample,
    tiny_qwen3,
)
from trainer.training.compile import RowBuckets
from trainer.training.gated_deltanet import TreeLayout, tree_causal_conv, tree_gated_delta_rule
from trainer.training.logprobs import forward_packed
from trainer.training.packing import _Trie, build_row
from trainer.training.tree_attention import enable_tree_attention

LINEAR = {  # two value heads per key head: the grouped case the stock layer repeats
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
LAYERS = ["linear_attention", "full_attention", "linear_attention"]


def tiny_qwen3_5() -> Qwen3_5ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**SMALL, **LINEAR, num_hidden_layers=3, layer_types=LAYERS)
    return Qwen3_5ForCausalLM(config).float()


def tiny_qwen3_next() -> Qwen3NextForCausalLM:
    torch.manual_seed(0)
    config = Qwen3NextConfig(
        **SMALL, **LINEAR, num_hidden_layers=3, layer_types=LAYERS, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=2, num_experts_per_tok=1,
    )
    return Qwen3NextForCausalLM(config).float()


def branching_groups(seed: int) -> list:
    """Groups sharing a system prompt; completions of different lengths, some forking 1-3 tokens after a branch point.

    A fork that close to a branch point puts the conv window (4 taps) across it; completions longer than a
    64-token chunk make the delta rule carry state across chunks inside a segment.
    """
    rng = random.Random(seed)
    tokens = lambda k: [rng.randrange(VOCAB) for _ in range(k)]  # noqa: E731
    system, samples = tokens(6), []
    for g in range(3):
        prompt = system + tokens(rng.randrange(2, 9))
        first = prompt + tokens(rng.randrange(3, 80))
        samples.append(random_sample(rng, first, len(prompt), g))
        for cut in (1, 2, 3):  # forks inside the conv window of the first completion's branch point
            samples.append(random_sample(rng, first[: len(prompt) + cut] + tokens(rng.randrange(1, 7)), len(prompt), g))
        samples.extend(random_sample(rng, prompt + tokens(rng.randrange(1, 12)), len(prompt), g) for _ in range(2))
        samples.append(random_sample(rng, first + tokens(5), len(first), g))  # extends a completion (multi-turn)
    return samples


@pytest.mark.parametrize("build", [tiny_qwen3_5, tiny_qwen3_next], ids=["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_hybrid_matches_each_sample_alone(build, seed: int) -> None:
    reference = build()
    samples = branching_groups(seed)
    assert int(build_row(samples).segment_ids.max()) + 1 > len(samples)  # branch points below the roots
    assert_packed_matches_alone(reference, samples, seed, atol=5e-5, grad_atol=5e-5)
    model = enable_tree_attention(copy.deepcopy(reference))
    # The stock forward still runs unchanged on plain input (generation, warm start).
    ids = torch.tensor(samples[0].sequence.input_ids)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5)


def sample_paths(samples: list) -> list[list[int]]:
    """Each sample's row indices, root to leaf (the trie build_row lays out, walked per sample)."""
    trie = _Trie(share_prefixes=True)
    paths = [trie.insert(s.sequence.input_ids) for s in samples]
    index, _, _ = trie.layout()
    return [[index[node] for node in path] for path in paths]


def _path_reference(x: torch.Tensor, weight: torch.Tensor, path: list[int]) -> torch.Tensor:
    """causal_conv1d over one trie path (the stock depthwise conv, zero-padded on the left)."""
    seq = x[path].T[None]  # (1, C, L)
    return F.conv1d(seq, weight[:, None], padding=weight.shape[1] - 1, groups=x.shape[1])[0, :, : len(path)].T


def test_depth_first_convolution_is_wrong_at_branch_points_and_the_tree_one_is_right() -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(5)]
    samples = [random_sample(rng, prompt + branch, len(prompt), 0) for branch in ([1, 2, 3, 4], [5, 6], [7, 8, 9])]
    # Nodes are keyed on (token, next token), so the last prompt token is one node per branch: the row is
    # p0 p1 p2 p3 | p4 1 2 3 4 | p4 5 6 | p4 7 8 9, siblings right after each other.
    row = build_row(samples)
    n, window = row.input_ids.numel(), 4
    layout = TreeLayout.from_row(row, window)
    x, weight = torch.randn(n, 3), torch.randn(3, window)
    tree = tree_causal_conv(x, weight, None, layout.ancestors, "identity")
    dfs = _path_reference(x, weight, list(range(n)))  # the old layout-order convolution
    first_of_second_branch = 9  # its depth-first neighbour is token 4, the first branch's last token
    for sample, path in zip(samples, sample_paths(samples), strict=True):
        assert row.input_ids[path].tolist() == sample.sequence.input_ids
        torch.testing.assert_close(tree[path], _path_reference(x, weight, path), rtol=0, atol=1e-6)
    # Depth-first, the second branch's first token would read the first branch's last tokens; on its
    # own path it reads p3 p2 p1.
    assert torch.equal(layout.ancestors[first_of_second_branch], torch.tensor([9, 3, 2, 1]))
    assert not torch.allclose(dfs[first_of_second_branch], tree[first_of_second_branch], atol=1e-3)


def test_tree_delta_rule_starts_each_segment_from_its_parents_state() -> None:
    """The varlen tree rule equals the token-by-token recurrence along each sample's own path."""
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(70)]  # longer than one 64-token chunk
    samples = [random_sample(rng, prompt + [rng.randrange(VOCAB) for _ in range(k)], len(prompt), 0) for k in (3, 90)]
    samples.append(random_sample(rng, samples[1].sequence.input_ids[:75] + [1, 2], len(prompt), 0))
    row = build_row(samples)
    layout = TreeLayout.from_row(row, 4)
    assert len(layout.levels) == 3
    n, heads = row.input_ids.numel(), 2
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(n, heads, 16, generator=g), torch.randn(n, heads, 16, generator=g)
    v = torch.randn(n, heads, 8, generator=g)
    decay, beta = -torch.rand(n, heads, generator=g), torch.rand(n, heads, generator=g)
    out = tree_gated_delta_rule(q, k, v, decay, beta, layout)
    for sample, path in zip(samples, sample_paths(samples), strict=True):
        assert row.input_ids[path].tolist() == sample.sequence.input_ids
        ref, _ = torch_recurrent_gated_delta_rule(
            q[path][None], k[path][None], v[path][None], g=decay[path][None], beta=beta[path][None],
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[path], ref[0], rtol=0, atol=2e-5)


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_qwen3_5, tiny_qwen3_next], ids=["qwen3", "qwen3_5", "qwen3_next"])
def test_padding_a_row_to_its_bucket_changes_no_log_prob_or_gradient(build: Any) -> None:
    """The compiled step pads rows to a bucket (``compile_row_bucket``): a chain of pads at the trie's
    root, which no real token sees, in attention, the conv window or the recurrent state."""
    model = enable_tree_attention(build())
    row = build_row(random_groups(0))
    padded = RowBuckets(64)(row)
    n = row.input_ids.numel()
    assert padded.input_ids.numel() % 64 == 0 and padded.input_ids.numel() > n
    assert (padded.num_unique_tokens, padded.attention_cost) == (row.num_unique_tokens, row.attention_cost)
    grads = []
    for r in (row, padded):
        model.zero_grad(set_to_none=True)
        out = forward_packed(model, r, 0.7, chunk_size=16)
        (out.logp.sum() + out.topk_logp[torch.isfinite(out.topk_logp)].sum()).backward()
        grads.append((out.logp.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=1e-5)
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")  # noqa: B023


def test_row_buckets_raise_the_recompile_limit_with_the_buckets_seen() -> None:
    import torch._dynamo.config as dynamo_config

    before = dynamo_config.recompile_limit
    buckets = RowBuckets(4)
    try:
        for length in range(1, 60, 3):  # 15 buckets of 4 tokens
            ids = list(range(length + 1))
            buckets(build_row([random_sample(random.Random(length), ids, 1, 0)]))
        assert len(buckets.lengths) == 15 and dynamo_config.recompile_limit >= 15
    finally:
        dynamo_config.recompile_limit = before
