"""The loss of docs/loss.md: score centering properties, masks, the clipped surrogate, normalisation, metrics."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from trainer.training.logprobs import RowLogProbs
from trainer.training.loss import LossConfig, grpo_loss, loss_metrics, reduce_loss_stats
from trainer.training.packing import PackedRow

V = 12


def make_row(targets, logq, advantages, topk_ids=None, topk_logq=None, token_sample=None) -> PackedRow:
    """A row of T trained tokens, token t predicted at position t (one sample unless ``token_sample``)."""
    T = len(targets)
    topk_ids = torch.zeros(T, 0, dtype=torch.long) if topk_ids is None else topk_ids
    topk_logq = torch.zeros(topk_ids.shape) if topk_logq is None else topk_logq
    owner = torch.zeros(T, dtype=torch.long) if token_sample is None else torch.tensor(token_sample)
    return dataclasses.replace(
        PackedRow.empty(),
        pred_index=torch.arange(T),
        target_ids=torch.as_tensor(targets),
        advantages=torch.as_tensor(advantages, dtype=torch.float32),
        sampler_logprobs=torch.as_tensor(logq, dtype=torch.float32),
        sampler_topk_ids=topk_ids,
        sampler_topk_logprobs=topk_logq,
        sampler_topk_valid=torch.ones(topk_ids.shape, dtype=torch.bool),
        token_sample=owner,
        sample_group_ids=(0,) * (int(owner.max()) + 1 if T else 0),
    )


def logps_from(z: torch.Tensor, row: PackedRow) -> RowLogProbs:
    """Trainer log-probs from per-position logits z (P, V)."""
    lsm = torch.log_softmax(z, -1)[row.pred_index]  # (T, V)
    entropy = -(lsm.exp() * lsm).sum(-1).detach()
    return RowLogProbs(lsm.gather(1, row.target_ids[:, None]).squeeze(1), lsm.gather(1, row.sampler_topk_ids), entropy)


def random_setup(seed: int, T: int = 6, K: int = 4):
    """Logits z (T, V) of p, a different sampler q, sampled targets, the sampler's top-K."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, V, generator=g).mul(2).requires_grad_()
    logq_all = torch.log_softmax(z.detach() + torch.randn(T, V, generator=g), -1)  # (T, V)
    targets = torch.multinomial(logq_all.exp(), 1, generator=g).squeeze(1)
    topk_logq, topk_ids = logq_all.topk(K, -1)
    advantages = torch.randn(T, generator=g)
    row = make_row(targets, logq_all.gather(1, targets[:, None]).squeeze(1), advantages, topk_ids, topk_logq)
    return z, row


def test_p_equal_q_is_plain_reinforce() -> None:
    z, row = random_setup(0)
    lsm = torch.log_softmax(z.detach(), -1)
    row = dataclasses.replace(
        row,
        sampler_logprobs=lsm.gather(1, row.target_ids[:, None]).squeeze(1),
        sampler_topk_logprobs=lsm.gather(1, row.sampler_topk_ids),
    )
    logps = logps_from(z, row)
    loss, _ = grpo_loss(logps, row, LossConfig(), num_trained_global=10)
    (grad,) = torch.autograd.grad(loss, z)
    (reinforce,) = torch.autograd.grad(-(row.advantages * logps_from(z, row).logp).sum() / 10, z)
    torch.testing.assert_close(grad, reinforce, rtol=0, atol=1e-7)
    assert grad.abs().max() > 1e-3


def literal_loss(logps: RowLogProbs, row: PackedRow, cfg: LossConfig, n: int) -> torch.Tensor:
    """docs/loss.md's score-centering formula written literally, one token at a time (the reference)."""

    def w(x: float) -> float:
        return x if cfg.clip_min <= x <= cfg.clip_max else 0.0

    total = 0.0
    for t in range(row.num_trained):
        logp_y, logq_y = logps.logp[t], float(row.sampler_logprobs[t])
        r = math.exp(float(logp_y.detach()) - logq_y)
        p = logps.topk_logp[t].detach().exp()
        q = row.sampler_topk_logprobs[t].exp()
        rho = float((1 - q.sum()) / (1 - p.sum()))
        alpha = rho * w(1 / rho)
        coef = torch.tensor([float(q[v]) * w(float(p[v] / q[v])) - alpha * float(p[v]) for v in range(len(p))])
        total = total - row.advantages[t] * (w(r) * logp_y - (coef * logps.topk_logp[t]).sum())
    return total / n


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_score_centering_matches_the_formula(seed: int) -> None:
    z, row = random_setup(seed)
    cfg = LossConfig(clip_min=0.7, clip_max=1.6)  # narrow: some ratios fall outside
    loss, _ = grpo_loss(logps_from(z, row), row, cfg, num_trained_global=7)
    ref = literal_loss(logps_from(z, row), row, cfg, 7)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(loss, z)[0], torch.autograd.grad(ref, z)[0], rtol=1e-5, atol=1e-7)


def expected_gradient(cfg: LossConfig, with_centering: bool, seed: int = 0) -> torch.Tensor:
    """E_{y ~ q}[grad L(y)] at one position with a constant advantage and H = the whole vocabulary.

    One trained token per possible y, each with advantage q_y: the sum over tokens is the expectation.
    """
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, V, generator=g).mul(2).requires_grad_()
    logq = torch.log_softmax(z.detach()[0] + torch.randn(V, generator=g), -1)
    ratios = (torch.log_softmax(z.detach()[0], -1) - logq).exp()
    assert ((ratios < cfg.clip_min) | (ratios > cfg.clip_max)).any() and ((ratios > 0.5) & (ratios < 2)).any()
    all_ids = torch.arange(V)[None].expand(V, V) if with_centering else torch.zeros(V, 0, dtype=torch.long)
    row = make_row(torch.arange(V), logq, logq.exp(), all_ids, logq[all_ids])
    lsm = torch.log_softmax(z, -1)[0]  # every token sees the same position
    logps = RowLogProbs(lsm, lsm[all_ids], torch.zeros(V))
    loss, _ = grpo_loss(logps, row, cfg, num_trained_global=1)
    return torch.autograd.grad(loss, z)[0]


def test_full_vocabulary_centering_has_zero_expected_gradient() -> None:
    cfg = LossConfig(clip_min=0.5, clip_max=2.0)
    torch.testing.assert_close(expected_gradient(cfg, True), torch.zeros(1, V), rtol=0, atol=1e-6)
    assert expected_gradient(cfg, False).abs().max() > 1e-2  # importance weighting alone drifts


def test_tokens_outside_the_mask_bounds_get_no_gradient() -> None:
    ratios = torch.tensor([0.49, 0.51, 4.9, 5.1])
    z = torch.randn(4, V).requires_grad_()
    targets = torch.arange(4)
    logp = torch.log_softmax(z.detach(), -1).gather(1, targets[:, None]).squeeze(1)
    row = make_row(targets, logp - ratios.log(), torch.ones(4))
    for cfg in (LossConfig(), LossConfig(score_centering=False, epsilon=10.0)):  # no trust-region clip
        loss, stats = grpo_loss(logps_from(z, row), row, cfg, num_trained_global=4)
        grad = torch.autograd.grad(loss, z)[0]
        assert grad[[0, 3]].abs().max() == 0 and grad[1].abs().max() > 0 and grad[2].abs().max() > 0
        assert stats["masked_tokens"] == 2


def test_clipped_surrogate() -> None:
    ratios = torch.tensor([1.5, 1.5, 0.6, 0.6, 1.1])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    z = torch.randn(5, V).requires_grad_()
    targets = torch.arange(5)
    logp = torch.log_softmax(z.detach(), -1).gather(1, targets[:, None]).squeeze(1)
    row = make_row(targets, logp - ratios.log(), advantages)
    cfg = LossConfig(score_centering=False, epsilon=0.2, epsilon_high=0.28)
    loss, stats = grpo_loss(logps_from(z, row), row, cfg, num_trained_global=8)
    clipped = ratios.clamp(0.8, 1.28)
    torch.testing.assert_close(loss, -torch.minimum(ratios * advantages, clipped * advantages).sum() / 8)
    grad = torch.autograd.grad(loss, z)[0]
    has_grad = [bool(grad[t].abs().max() > 0) for t in range(5)]
    assert has_grad == [False, True, True, False, True]  # the clip binds at high for A > 0, low for A < 0
    assert (stats["clip_high_tokens"], stats["clip_low_tokens"], stats["clip_region_tokens"]) == (1, 1, 2)


def test_normalisation_by_trained_tokens_over_the_micro_batch() -> None:
    z, row = random_setup(4, T=6)
    halves = [
        dataclasses.replace(
            row, **{f: getattr(row, f)[sl] for f in ("target_ids", "advantages", "sampler_logprobs",
                                                      "sampler_topk_ids", "sampler_topk_logprobs",
                                                      "sampler_topk_valid", "token_sample")},
            pred_index=torch.arange(6)[sl],
        )
        for sl in (slice(0, 2), slice(2, 6))
    ]
    for cfg in (LossConfig(), LossConfig(score_centering=False)):
        whole, _ = grpo_loss(logps_from(z, row), row, cfg, num_trained_global=6)
        parts = sum(grpo_loss(logps_from(z, h), h, cfg, num_trained_global=6)[0] for h in halves)
        torch.testing.assert_close(parts, whole)
        doubled, _ = grpo_loss(logps_from(z, row), row, cfg, num_trained_global=12)
        torch.testing.assert_close(doubled, whole / 2)


def test_statistics_and_metrics() -> None:
    ratios = torch.tensor([0.5, 0.7, 1.0, 1.3, 2.0, 6.0])
    z = torch.randn(6, V)
    targets = torch.arange(6)
    logp = torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1)
    topk_ids = torch.tensor([[0, 1]] * 6)
    topk_logq = torch.log(torch.tensor([[0.5, 0.2]] * 6))
    row = make_row(targets, logp - ratios.log(), torch.ones(6), topk_ids, topk_logq, token_sample=[0, 0, 0, 1, 1, 1])
    _, stats = grpo_loss(logps_from(z, row), row, LossConfig(), num_trained_global=6)
    empty = grpo_loss(logps_from(z[:0], PackedRow.empty()), PackedRow.empty(), LossConfig(), 6)[1]
    m = loss_metrics(reduce_loss_stats([stats, empty]))
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.5)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(6.0)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(ratios.mean()))
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(6.0))
    assert m["sampling/masked_mean"] == pytest.approx(1 / 6)  # 6.0 > clip_max; 0.5 is kept
    assert m["sampling/sampler_mass"] == pytest.approx(0.7)
    assert m["entropy"] == pytest.approx(float(logps_from(z, row).entropy.mean()))
    assert m["clip_ratio/low_mean"] == pytest.approx(2 / 6) and m["clip_ratio/high_mean"] == pytest.approx(3 / 6)
    assert m["clip_ratio/region_mean"] == pytest.approx(5 / 6)
    assert m["clip_ratio/low_min"] == 0.0 and m["clip_ratio/high_max"] == 1.0  # per completion
    assert loss_metrics(empty) == {}


def test_empty_row_loss_is_zero() -> None:
    row = PackedRow.empty()
    loss, stats = grpo_loss(logps_from(torch.zeros(0, V), row), row, LossConfig(), num_trained_global=0)
    assert loss == 0 and stats["trained_tokens"] == 0 and stats["is_ratio_min"] == math.inf


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"clip_min": 1.5}, "clip_min <= 1 <= clip_max"), ({"epsilon": -0.1}, "epsilon")]
)
def test_config_rules(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)
