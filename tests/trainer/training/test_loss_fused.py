"""The fused head loss (gradient formed in the forward) equals log-probs + ``grpo_loss``.

Same loss value, statistics and gradients of every parameter, in both loss modes.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from functools import partial

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.records import TrainingSample, TrainingSequence
from trainer.training.logprobs import (
    forward_packed,
    head_loss_from_hidden,
    logprobs_from_hidden,
)
from trainer.training.loss import LossConfig, _token_losses, grpo_loss, packed_grpo_loss
from trainer.training.packing import PackedRow, build_row
from trainer.training.tree_attention import enable_tree_attention

N, D, V, K, M = 29, 16, 40, 5, 7
CONFIGS = {
    "score centering": LossConfig(clip_min=0.7, clip_max=1.6),  # narrow: some ratios fall outside
    "clipped surrogate": LossConfig(score_centering=False, epsilon=0.1, clip_min=0.5, clip_max=2.0),
}


def random_row(seed: int, trained: int = 23, candidates: bool = True) -> PackedRow:
    """Random targets, advantages, sampler log-probs near and far from p, top-K (some padded) and candidate sets."""
    g = torch.Generator().manual_seed(seed)
    row = dataclasses.replace(
        PackedRow.empty(),
        input_ids=torch.zeros(N, dtype=torch.long),
        pred_index=torch.randint(0, N, (trained,), generator=g),
        target_ids=torch.randint(0, V, (trained,), generator=g),
        advantages=torch.randn(trained, generator=g),
        sampler_logprobs=-torch.rand(trained, generator=g) * 4,
        sampler_topk_ids=torch.randint(0, V, (trained, K), generator=g),
        sampler_topk_logprobs=-torch.rand(trained, K, generator=g) * 4 - 1,
        sampler_topk_valid=torch.rand(trained, K, generator=g) < 0.8,
        token_sample=torch.arange(trained) % 3,
        sample_group_ids=(0, 0, 1),
    )
    if candidates:
        cand_ids = torch.randint(0, V, (trained, M), generator=g)
        cand_valid = torch.rand(trained, M, generator=g) < 0.7
        cand_valid[::2] = False  # every other token: the whole vocabulary
        has_set = cand_valid.any(-1)
        row.target_ids[has_set] = cand_ids[has_set, cand_valid[has_set].int().argmax(-1)]  # a target is a candidate
        row = dataclasses.replace(row, candidate_ids=cand_ids, candidate_valid=cand_valid)
    return row


class Toy(torch.nn.Module):
    """Hidden states from a parameter, then a head: gradients reach both."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=bias)
        self.x = torch.randn(N, D)

    def hidden(self) -> torch.Tensor:
        return torch.tanh(self.body(self.x)) * 3  # large enough logits for peaked distributions


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return out


def assert_same(fused: tuple, reference: tuple) -> None:
    """Same loss value, statistics and gradients (all parameters)."""
    (loss, stats, g), (ref_loss, ref_stats, ref_g) = fused, reference
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    assert stats.keys() == ref_stats.keys()
    for key in stats:
        torch.testing.assert_close(stats[key], ref_stats[key], rtol=1e-5, atol=1e-5, msg=key)
    for name in ref_g:
        torch.testing.assert_close(g[name], ref_g[name], rtol=1e-5, atol=1e-7, msg=name)
        assert g[name].abs().max() > 0 or ref_g[name].abs().max() == 0


@pytest.mark.parametrize("mode", CONFIGS)
@pytest.mark.parametrize(("chunk_size", "candidates", "bias", "temperature"), [
    (1, True, True, 0.8), (4, True, False, 1.0), (7, False, True, 1.3), (512, True, True, 0.8),
])
def test_fused_equals_logprobs_then_loss(mode: str, chunk_size: int, candidates: bool, bias: bool, temperature: float):
    cfg, toy = CONFIGS[mode], Toy(bias)
    row = random_row(chunk_size, candidates=candidates)
    # Sampler log-probs around the trainer's, so that some ratios fall inside the masks and some outside.
    with torch.no_grad():
        truth = logprobs_from_hidden(toy.hidden(), toy.head, row, temperature)
    noise = torch.randn(row.num_trained, generator=torch.Generator().manual_seed(1)) * 0.4
    row = dataclasses.replace(row, sampler_logprobs=truth.logp + noise)
    n_global, accumulation = row.num_trained + 5, 3  # other processes' tokens; gradient accumulation

    logps = logprobs_from_hidden(toy.hidden(), toy.head, row, temperature, chunk_size)
    ref_loss, ref_stats = grpo_loss(logps, row, cfg, n_global)
    (ref_loss / accumulation).backward()
    reference = (ref_loss.detach(), ref_stats, grads(toy))

    loss, logps_fused = head_loss_from_hidden(
        toy.hidden(), toy.head, row, temperature, partial(_token_losses, cfg=cfg), n_global, chunk_size
    )
    assert not logps_fused.logp.requires_grad and not logps_fused.entropy.requires_grad
    stats = grpo_loss(logps_fused, row, cfg, n_global)[1]
    (loss / accumulation).backward()
    assert_same((loss.detach(), stats, grads(toy)), reference)
    torch.testing.assert_close(logps_fused.topk_logp, logps.topk_logp.detach(), rtol=0, atol=1e-6)  # -inf too
    assert 0 < ref_stats["masked_tokens"] < row.num_trained  # both sides of the masks were exercised


def test_empty_row_gives_zero_loss_and_zero_gradients_everywhere() -> None:
    toy = Toy(bias=True)
    loss, logps = head_loss_from_hidden(
        toy.hidden()[:1], toy.head, PackedRow.empty(), 1.0, partial(_token_losses, cfg=LossConfig()), 1
    )
    assert loss.item() == 0 and logps.logp.shape == (0,) and logps.topk_logp.shape == (0, 0)
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in toy.parameters())


def test_backward_twice_is_refused() -> None:
    toy = Toy(bias=False)
    row = random_row(0)
    loss, _ = head_loss_from_hidden(toy.hidden(), toy.head, row, 1.0, partial(_token_losses, cfg=LossConfig()), 9)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated twice"):
        loss.backward()


def tree_samples(seed: int, vocab: int) -> list[TrainingSample]:
    """Two groups of samples sharing prompts, with sampler top-k and (for some tokens) candidate sets."""
    rng = random.Random(seed)
    samples = []
    for g in range(2):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(4, 10))]
        for _ in range(3):
            ids = prompt + [rng.randrange(vocab) for _ in range(rng.randrange(2, 9))]
            mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
            top = [{rng.randrange(vocab): -rng.random() - 1 for _ in range(3)} if m else None for m in mask]
            cand = [sorted({ids[i], *rng.sample(range(vocab), 6)}) if m and rng.random() < 0.5 else None
                    for i, m in enumerate(mask)]
            seq = TrainingSequence(ids, mask, [-rng.random() * 3 for _ in ids], top, cand)
            samples.append(TrainingSample(seq, advantage=rng.uniform(-1, 1), group_id=g, policy_version=0))
    return samples


@pytest.mark.parametrize("mode", CONFIGS)
def test_packed_grpo_loss_equals_forward_packed_then_grpo_loss_on_a_model(mode: str) -> None:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=48, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_hidden_layers=2)
    reference = enable_tree_attention(Qwen3ForCausalLM(config).float())
    model = copy.deepcopy(reference)
    row = build_row(tree_samples(0, config.vocab_size))
    cfg, n_global = CONFIGS[mode], row.num_trained * 2

    ref_loss, ref_stats = grpo_loss(forward_packed(reference, row, 0.7, chunk_size=8), row, cfg, n_global)
    (ref_loss / 2).backward()
    loss, stats = packed_grpo_loss(model, row, 0.7, cfg, n_global, chunk_size=8)
    (loss / 2).backward()
    assert_same((loss.detach(), stats, grads(model)), (ref_loss.detach(), ref_stats, grads(reference)))
