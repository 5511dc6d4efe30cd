"""Gemma 2 on packed rows: attention logit soft-capping, sliding-window layers, final-logit soft-capping."""

from __future__ import annotations

import dataclasses
import random
import warnings
from functools import partial

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from tests.trainer.training.test_loss_fused import CONFIGS, Toy, assert_same, grads, random_row
from tests.trainer.training.test_tree_attention import SMALL, VOCAB, assert_packed_matches_alone, random_sample
from trainer.records import TrainingSample
from trainer.training import tree_attention
from trainer.training.logprobs import final_logit_softcap, head_loss_from_hidden, logprobs_from_hidden
from trainer.training.loss import _token_losses, grpo_loss
from trainer.training.packing import build_row
from trainer.training.tree_attention import (
    UnsupportedModelError,
    check_softcap_device,
    check_tree_attention_support,
    dense_tree_mask,
    dense_window_mask,
    flex_tree_mask,
    tree_attention_forward,
)

WINDOW = 4


def tiny_gemma2(**overrides: object) -> Gemma2ForCausalLM:
    """Four layers, alternating sliding (window 4) and full attention; small caps so soft-capping bites."""
    torch.manual_seed(0)
    settings = {
        "num_hidden_layers": 4, "sliding_window": WINDOW, "attn_logit_softcapping": 0.5,
        "final_logit_softcapping": 1.5, "query_pre_attn_scalar": 32,
    }
    config = Gemma2Config(**SMALL, **{**settings, **overrides})
    config._attn_implementation = "eager"
    return Gemma2ForCausalLM(config).float()


def long_branches(seed: int) -> list[TrainingSample]:
    """Samples sharing a prompt, forking at several depths, all far longer than the window."""
    rng = random.Random(seed)
    tokens = lambda k: [rng.randrange(VOCAB) for _ in range(k)]  # noqa: E731
    prompt = tokens(9)
    turn = prompt + tokens(7)
    ids = [turn, turn + tokens(6), turn[:-3] + tokens(8), prompt + tokens(5), list(turn)]
    return [random_sample(rng, s, len(prompt), group=0) for s in ids]


def test_gemma2_config_is_what_the_test_means() -> None:
    config = tiny_gemma2().config
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert config.attn_logit_softcapping == 0.5
    assert final_logit_softcap(tiny_gemma2()) == 1.5


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_gemma2_matches_each_sample_alone(seed: int) -> None:
    """Soft-capped, windowed, packed log-probs (chunked head, final cap) and gradients equal the stock
    eager model on each sample."""
    assert_packed_matches_alone(tiny_gemma2(), long_branches(seed), seed)


def test_window_mask_hides_keys_beyond_the_window_along_the_path() -> None:
    samples = long_branches(0)
    row = build_row(samples)
    tree = dense_tree_mask(row.dfs_enter, row.dfs_leave)[0, 0]
    windowed = tree & dense_window_mask(row.position_ids, WINDOW)[0, 0]
    pos = row.position_ids
    for q in range(row.input_ids.numel()):
        path = tree[q].nonzero().flatten()  # q's ancestors and q, one per depth 0..pos[q]
        assert torch.equal(pos[path], torch.arange(int(pos[q]) + 1))
        seen = windowed[q].nonzero().flatten()
        assert torch.equal(seen, path[pos[path] > pos[q] - WINDOW])  # the last WINDOW tokens of its path
    assert (tree & ~windowed).any()  # the window did hide something


@pytest.mark.slow  # flex attention compiles its block mask: about 12 s
def test_flex_window_block_mask_matches_the_dense_mask() -> None:
    """Compiled FlexAttention (CPU forward) with the windowed BlockMask and the soft-cap score_mod."""
    samples = [s for seed in range(12) for s in long_branches(seed)]
    row = build_row(samples, share_prefixes=False)  # several tiles of 128 tokens
    n = row.input_ids.numel()
    assert n > 2 * 128
    dense = (dense_tree_mask(row.dfs_enter, row.dfs_leave) & dense_window_mask(row.position_ids, WINDOW))
    block_mask = flex_tree_mask(row.dfs_enter, row.dfs_leave, row.position_ids, WINDOW)
    assert int(block_mask.full_kv_num_blocks.sum()) == 0  # every reached tile runs the mask function
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    # Fresh dynamo state before and after: compiling flex_attention again in one process for another
    # row length (test_tree_attention's) failed in inductor's CPU C++ codegen ('cur_qSplitSize8').
    torch._dynamo.reset()
    try:
        compiled = torch.compile(torch.nn.attention.flex_attention.flex_attention)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = compiled(q, k, v, block_mask=block_mask, enable_gqa=True,
                           score_mod=tree_attention._softcap_score_mod(0.5))
    finally:
        torch._dynamo.reset()
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = tree_attention._softcapped_attention(q, kr, vr, dense, None, 0.5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_unmasked_sliding_layer_is_causal_and_windowed() -> None:
    """Outside packed rows (no mask) a soft-capped sliding layer equals the eager reference."""
    q, k, v = torch.randn(1, 4, 11, 32), torch.randn(1, 2, 11, 32), torch.randn(1, 2, 11, 32)
    out, _ = tree_attention_forward(torch.nn.Module(), q, k, v, None, 0.2, softcap=0.5, sliding_window=WINDOW)
    pos = torch.arange(11)
    mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < WINDOW)
    scores = 0.5 * torch.tanh(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.2 / 0.5)
    ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("hip", "capability", "refused"), [
    (None, (10, 0), "Blackwell"), (None, (12, 0), "Blackwell"), ("6.2", (9, 4), "AMD"), (None, (9, 0), None),
])
def test_softcap_refused_only_on_amd_and_blackwell(
    monkeypatch: pytest.MonkeyPatch, hip: str | None, capability: tuple[int, int], refused: str | None
) -> None:
    """No such GPU here: torch's device queries are stand-ins (monkeypatched) for the device's answers."""
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    if refused is None:
        check_softcap_device(cuda)
    else:
        with pytest.raises(UnsupportedModelError, match=f"soft-cap attention logits.*{refused}"):
            check_softcap_device(cuda)
    check_softcap_device(torch.device("cpu"))  # CPU is never refused


def test_supported_on_cpu() -> None:
    check_tree_attention_support(tiny_gemma2())  # soft-capped attention, sliding layers, capped final logits


@pytest.mark.parametrize("mode", CONFIGS)
def test_fused_head_loss_goes_through_the_final_cap(mode: str) -> None:
    """The fused head loss with a final-logit cap equals capped log-probs + ``grpo_loss`` (loss, stats, gradients)."""
    cfg, toy, cap, temperature = CONFIGS[mode], Toy(bias=True), 2.0, 0.8
    row = random_row(3)
    with torch.no_grad():
        truth = logprobs_from_hidden(toy.hidden(), toy.head, row, temperature, softcap=cap)
        uncapped = logprobs_from_hidden(toy.hidden(), toy.head, row, temperature)
    assert (truth.logp - uncapped.logp).abs().max() > 0.1  # the cap bites
    noise = torch.randn(row.num_trained, generator=torch.Generator().manual_seed(1)) * 0.4
    row = dataclasses.replace(row, sampler_logprobs=truth.logp + noise)
    capped = logprobs_from_hidden(toy.hidden(), toy.head, row, temperature, 4, cap)
    ref_loss, ref_stats = grpo_loss(capped, row, cfg, 30)
    ref_loss.backward()
    reference = (ref_loss.detach(), ref_stats, grads(toy))
    loss, logps = head_loss_from_hidden(
        toy.hidden(), toy.head, row, temperature, partial(_token_losses, cfg=cfg), 30, 4, softcap=cap
    )
    loss.backward()
    assert_same((loss.detach(), grpo_loss(logps, row, cfg, 30)[1], grads(toy)), reference)
