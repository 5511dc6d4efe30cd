"""Tree attention: the packed forward of a stock model equals forwarding each sample alone."""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from trainer.records import TrainingSample, TrainingSequence
from trainer.training.logprobs import forward_packed
from trainer.training.packing import PackedRow, build_row
from trainer.training.tree_attention import (
    TREE_ATTENTION,
    UnsupportedModelError,
    dense_tree_mask,
    enable_tree_attention,
    flex_tree_mask,
    packed_hidden_states,
)

VOCAB = 48
TEMPERATURE = 0.7
SMALL = {  # head_dim 32: the shape the CPU attention paths support
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32,
}


def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**SMALL, num_hidden_layers=2)).float()


def random_sample(rng: random.Random, ids: list[int], trained_from: int, group: int) -> TrainingSample:
    """Tokens from ``trained_from`` on are trained, each with random sampler top-k and a candidate set."""
    n = len(ids)
    mask = [0] * trained_from + [1] * (n - trained_from)
    top = [{rng.randrange(VOCAB): -rng.random() for _ in range(3)} if m else None for m in mask]
    cand = [
        sorted({ids[i], *rng.sample(range(VOCAB), 6)}) if m and rng.random() < 0.5 else None
        for i, m in enumerate(mask)
    ]
    seq = TrainingSequence(ids, mask, [-rng.random() for _ in ids], sampler_top_logprobs=top, sampling_masks=cand)
    return TrainingSample(seq, advantage=rng.uniform(-1, 1), group_id=group, policy_version=0)


def random_groups(seed: int) -> list[TrainingSample]:
    """Groups sharing prompts, different completions, duplicates, and multi-turn forks."""
    rng = random.Random(seed)
    tokens = lambda k: [rng.randrange(VOCAB) for _ in range(k)]  # noqa: E731
    samples = []
    system = tokens(5)  # shared across groups
    for g in range(2):
        prompt = system + tokens(rng.randrange(3, 12))
        turn1 = prompt + tokens(rng.randrange(2, 8))
        samples.append(random_sample(rng, turn1, len(prompt), g))
        samples.append(random_sample(rng, turn1 + tokens(4) + tokens(3), len(turn1) + 4, g))  # extends turn 1
        samples.append(random_sample(rng, turn1[:-1] + tokens(5), len(prompt), g))  # forks inside turn 1
        samples.append(random_sample(rng, list(turn1), len(prompt), g))  # a duplicate completion
        samples.extend(random_sample(rng, prompt + tokens(rng.randrange(1, 9)), len(prompt), g) for _ in range(2))
    return samples


def reference_logprobs(model: Qwen3ForCausalLM, sample: TrainingSample, row: PackedRow, s: int):
    """log p(target) and log p(top-k) of sample ``s``'s trained tokens from a plain forward of it alone."""
    ids = torch.tensor(sample.sequence.input_ids)[None]
    logits = model(input_ids=ids).logits[0].float() / TEMPERATURE  # (L, V)
    positions = torch.tensor([i - 1 for i, m in enumerate(sample.sequence.loss_mask) if m])
    mine = row.token_sample == s
    z = logits[positions]  # (T_s, V)
    if row.candidate_ids is not None:
        keep = torch.zeros_like(z, dtype=torch.bool)
        for t, (ids, valid) in enumerate(zip(row.candidate_ids[mine], row.candidate_valid[mine], strict=True)):
            keep[t, ids[valid]] = True
        z = z.masked_fill(~(keep | ~row.candidate_valid[mine].any(-1, keepdim=True)), float("-inf"))
    logp = torch.log_softmax(z, -1)
    return logp.gather(1, row.target_ids[mine][:, None]).squeeze(1), logp.gather(1, row.sampler_topk_ids[mine])


def assert_packed_matches_alone(reference: torch.nn.Module, samples: list[TrainingSample], seed: int,
                                atol: float = 2e-5, grad_atol: float = 1e-5) -> None:
    """Log-probs (target and top-k) and every parameter's gradient of the tree-packed ``samples`` equal
    each sample forwarded alone by the stock ``reference`` model."""
    model = enable_tree_attention(copy.deepcopy(reference))
    row = build_row(samples)
    assert row.num_unique_tokens < row.num_unpacked_tokens  # something is shared

    out = forward_packed(model, row, TEMPERATURE, chunk_size=16)
    weights = torch.randn(row.num_trained, generator=torch.Generator().manual_seed(seed))
    finite = torch.isfinite(out.topk_logp)
    (weights @ out.logp + out.topk_logp[finite].sum()).backward()

    alone = [reference_logprobs(reference, smp, row, s) for s, smp in enumerate(samples)]
    ref_logp, ref_topk = (torch.cat(parts) for parts in zip(*alone, strict=True))
    torch.testing.assert_close(out.logp, ref_logp, rtol=0, atol=atol)
    torch.testing.assert_close(out.topk_logp, ref_topk, rtol=0, atol=atol)
    assert torch.equal(finite, torch.isfinite(ref_topk))
    (weights @ ref_logp + ref_topk[finite].sum()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=grad_atol, msg=lambda m: f"{name}: {m}")  # noqa: B023


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_forward_matches_each_sample_alone(seed: int) -> None:
    assert_packed_matches_alone(tiny_qwen3(), random_groups(seed), seed)


def test_llama_runs_unchanged_on_a_packed_row() -> None:
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(**SMALL, num_hidden_layers=1))
    model = enable_tree_attention(copy.deepcopy(reference))
    assert model.config._attn_implementation == TREE_ATTENTION
    samples = random_groups(3)[:3]
    row = build_row(samples)
    hidden = packed_hidden_states(model, row)  # (N, D)
    alone = reference.model(input_ids=torch.tensor(samples[1].sequence.input_ids)[None]).last_hidden_state[0]
    rows_of_sample_1 = row.pred_index[row.token_sample == 1]
    last = len(samples[1].sequence.input_ids) - 1
    torch.testing.assert_close(hidden[rows_of_sample_1[-1]], alone[last - 1], rtol=0, atol=1e-5)
    # Without a tree mask the backend is plain causal attention.
    ids = torch.tensor(samples[0].sequence.input_ids)[None]
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_flex_block_mask_matches_the_dense_mask() -> None:
    compiled_flex = torch.compile(torch.nn.attention.flex_attention.flex_attention)
    samples = [s for seed in range(8) for s in random_groups(seed)]
    for share in (True, False):
        row = build_row(samples, share_prefixes=share)  # several tiles of 128 tokens
        n = row.input_ids.numel()
        dense = dense_tree_mask(row.dfs_enter, row.dfs_leave)[0, 0]  # (N, N)
        block_mask = flex_tree_mask(row.dfs_enter, row.dfs_leave)
        nb = (n + 127) // 128
        tiles = torch.zeros(nb * 128, nb * 128, dtype=torch.bool)
        tiles[:n, :n] = dense
        tiles = tiles.view(nb, 128, nb, 128).transpose(1, 2)  # (Qb, Kb, 128, 128)
        assert torch.equal(block_mask.to_dense()[0, 0].bool(), tiles.any(-1).any(-1))
        full = torch.zeros(nb, nb, dtype=torch.bool)
        for qb in range(nb):
            count = int(block_mask.full_kv_num_blocks[0, 0, qb])
            full[qb, block_mask.full_kv_indices[0, 0, qb, :count].long()] = True
        assert torch.equal(full & ~tiles.all(-1).all(-1), torch.zeros_like(full))  # full tiles are full
        if not share:
            continue
        # Compiled FlexAttention skips empty tiles and the mask function on full ones (eager
        # FlexAttention evaluates every pair, so it would not see a wrong block structure).
        q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense[None, None]
        )
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_sink_models_are_refused() -> None:
    """(Recurrent families other than Gated DeltaNet: tests/trainer/training/test_gated_deltanet.py.)"""
    sinks = GptOssForCausalLM(
        GptOssConfig(
            **SMALL, num_local_experts=2, num_experts_per_tok=1, num_hidden_layers=1,
            layer_types=["full_attention"],
        )
    )
    with pytest.raises(UnsupportedModelError, match="attention sinks"):
        enable_tree_attention(sinks)


def test_forward_packed_through_ddp(tmp_path) -> None:
    """Wrapped models are called as a whole (DDP synchronises only the forwards it runs)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        bare = enable_tree_attention(tiny_qwen3())
        wrapped = DistributedDataParallel(copy.deepcopy(bare))
        reduced: list[int] = []

        def count_all_reduce(state, bucket):  # noqa: ANN001, ANN202  (DDP checks string annotations)
            reduced.append(bucket.index())
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        wrapped.register_comm_hook(None, count_all_reduce)
        row = build_row(random_groups(1))
        for step in range(2):  # the reducer must see a forward before every backward
            for model in (bare, wrapped):
                model.zero_grad()
                out = forward_packed(model, row, TEMPERATURE)
                out.logp.sum().backward()
            assert reduced.count(0) == step + 1  # DDP all-reduced the gradients of this step
            for p, q in zip(bare.parameters(), wrapped.module.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_packed_forward_needs_tree_attention_enabled() -> None:
    with pytest.raises(ValueError, match="enable_tree_attention"):
        packed_hidden_states(tiny_qwen3(), build_row(random_groups(0)[:2]))
