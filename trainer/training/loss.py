"""The GRPO loss of docs/loss.md: score centering with masked importance sampling, or the clipped surrogate.

The equations, their derivation and the properties the tests check are written once, in
``docs/loss.md``; the code below names its tensors after them. References: masked importance
sampling (Zheng et al. 2025, arXiv:2510.18855), the GRPO clipped surrogate (Shao et al. 2024,
arXiv:2402.03300) with DAPO's ``epsilon_high`` (Yu et al. 2025, arXiv:2503.14476).

Metrics come back as raw sums, counts and extremes: :data:`STAT_REDUCTIONS` says how to combine
them across rows, processes, micro-batches and logging windows, and :func:`loss_metrics` turns the
combined statistics into the metric names of TRL's AsyncGRPOTrainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from trainer.training.logprobs import (
    FUSED_CHUNK_SIZE,
    RowLogProbs,
    final_logit_softcap,
    head_loss_from_hidden,
)
from trainer.training.packing import PackedRow
from trainer.training.row_forward import row_hidden_states
from trainer.training.tree_attention import unwrap_model

__all__ = ["STAT_REDUCTIONS", "LossConfig", "grpo_loss", "loss_metrics", "packed_grpo_loss", "reduce_loss_stats"]


@dataclass(frozen=True)
class LossConfig:
    """Loss settings (the ``AsyncGRPOConfig`` fields of the same meaning).

    Args:
        epsilon: Lower trust-region half-width: the clipped surrogate clips r at 1 - epsilon;
            ``clip_ratio/*`` count tokens beyond it in both modes.
        epsilon_high: Upper half-width (1 + epsilon_high); ``None`` means ``epsilon``.
        score_centering: Score centering (default) instead of the clipped surrogate.
        clip_min: ``vllm_importance_sampling_clip_min``: tokens with r below are dropped.
        clip_max: ``vllm_importance_sampling_clip_max``: tokens with r above are dropped.
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    score_centering: bool = True
    clip_min: float = 0.5
    clip_max: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.clip_min <= 1 <= self.clip_max:
            raise ValueError(
                f"need clip_min <= 1 <= clip_max (r = 1 must be kept), got clip_min={self.clip_min}, "
                f"clip_max={self.clip_max}"
            )
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError(f"epsilon and epsilon_high must be >= 0, got {self.epsilon}, {self.epsilon_high}")

    @property
    def eps_high(self) -> float:
        """The upper half-width actually used."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _inside(ratio: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """1[clip_min <= ratio <= clip_max] as a bool tensor (NaN and inf are outside)."""
    return (ratio >= cfg.clip_min) & (ratio <= cfg.clip_max)


def _score_centered_objective(
    logp: torch.Tensor, r: torch.Tensor, topk_logp: torch.Tensor, row: PackedRow, cfg: LossConfig
) -> torch.Tensor:
    """J_t = sg[w(r_y)] log p_y - sum_{v in H} sg[q_v w(p_v / q_v) - alpha p_v] log p_v, so L_t = -A J_t (T,)."""
    w = r * _inside(r, cfg)  # (T,) w(r_y)
    in_H = row.sampler_topk_valid & torch.isfinite(topk_logp)  # (T, K) v in H, p_v > 0
    logp_H = topk_logp.masked_fill(~in_H, 0.0)  # (T, K) log p_v, differentiable
    p_H = logp_H.detach().exp() * in_H  # (T, K)
    q_H = row.sampler_topk_logprobs.exp() * in_H  # (T, K)
    # q_v w(p_v / q_v) = p_v 1[clip_min <= p_v / q_v <= clip_max]: no division by a tiny q_v.
    q_w = p_H * _inside(torch.exp(logp_H.detach() - row.sampler_topk_logprobs), cfg)  # (T, K)
    P_H, Q_H = p_H.sum(-1), q_H.sum(-1)  # (T,)
    # The tail V \ H is taken as p scaled by rho = (1 - Q_H) / (1 - P_H); alpha = rho w(1 / rho)
    # is then 1[clip_min <= 1 / rho <= clip_max], and 0 when the sampler has no tail.
    tail_p, tail_q = (1 - P_H).clamp_min(0), (1 - Q_H).clamp_min(0)  # (T,)
    inv_rho = torch.where(tail_q > 0, tail_p / tail_q, torch.full_like(tail_q, float("inf")))  # (T,)
    alpha = _inside(inv_rho, cfg).float()  # (T,)
    centering = ((q_w - alpha[:, None] * p_H) * logp_H).sum(-1)  # (T,) E_q[w score] over H, tail included
    return w * logp - centering


def _token_losses(logps: RowLogProbs, row: PackedRow, cfg: LossConfig) -> torch.Tensor:
    """L_t of docs/loss.md for each trained token (T,): a function of token t's own log-probs only."""
    logp = logps.logp  # (T,) log p_y, differentiable
    logq = row.sampler_logprobs  # (T,) log q_y from the sampler
    A = row.advantages  # (T,)
    r = (logp.detach() - logq).exp()  # (T,) importance ratio as a weight: no gradient
    if cfg.score_centering:
        return -A * _score_centered_objective(logp, r, logps.topk_logp, row, cfg)
    m = _inside(r, cfg).float()  # (T,) masked importance sampling: tokens outside are dropped
    ratio = torch.exp(logp - logq)  # (T,) the same ratio, with gradient: it is the objective
    return -m * torch.minimum(ratio * A, ratio.clamp(1 - cfg.epsilon, 1 + cfg.eps_high) * A)


def grpo_loss(
    logps: RowLogProbs, row: PackedRow, cfg: LossConfig, num_trained_global: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one row (``docs/loss.md``) and its raw metric statistics.

    Args:
        logps: Trainer log-probs of the row's trained tokens (:func:`trainer.training.logprobs.forward_packed`).
        row: The packed row (advantages, sampler log-probs and top-k, on the same device).
        cfg: Loss settings.
        num_trained_global: Trained tokens of the whole micro-batch, summed over all processes
            (the caller all-reduces it). The caller also divides by ``gradient_accumulation_steps``.

    Returns:
        ``(loss, stats)``: the scalar ``sum_t L_t / num_trained_global`` and a dict of detached
        0-d tensors (raw sums, counts and extremes; see :data:`STAT_REDUCTIONS`).
    """
    loss = _token_losses(logps, row, cfg).sum() / max(num_trained_global, 1)
    return loss, _stats(logps, row, cfg)


def packed_grpo_loss(
    model: nn.Module,
    row: PackedRow,
    temperature: float,
    cfg: LossConfig,
    num_trained_global: int,
    chunk_size: int = FUSED_CHUNK_SIZE,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``grpo_loss(forward_packed(model, row, temperature), row, cfg, num_trained_global)``, fused.

    The same loss, statistics and gradients, with the LM head's gradient formed during the forward
    (:func:`trainer.training.logprobs.head_loss_from_hidden`): three head matmuls per trained token instead
    of four, no recomputed logits. The loss may be scaled before its (single) backward.

    Args:
        model: A causal LM switched to tree attention, possibly wrapped (DDP, PEFT).
        row: The packed row, on the model's device.
        temperature: Sampling temperature.
        cfg: Loss settings.
        num_trained_global: As for :func:`grpo_loss`.
        chunk_size: Trained tokens per LM-head chunk.
    """
    hidden = row_hidden_states(model, row)  # (N, D)
    head = unwrap_model(model).get_output_embeddings()
    loss, logps = head_loss_from_hidden(
        hidden, head, row, temperature, partial(_token_losses, cfg=cfg), max(num_trained_global, 1), chunk_size,
        final_logit_softcap(model),
    )
    return loss, _stats(logps, row, cfg)


def _stats(logps: RowLogProbs, row: PackedRow, cfg: LossConfig) -> dict[str, torch.Tensor]:
    """Raw statistics of one row, all detached 0-d tensors."""
    log_ratio = logps.logp.detach() - row.sampler_logprobs  # (T,)
    r = log_ratio.exp()  # (T,)
    m = _inside(r, cfg).float()  # (T,)
    A = row.advantages
    low, high = r < 1 - cfg.epsilon, r > 1 + cfg.eps_high  # (T,) outside the trust region
    if not cfg.score_centering:  # where the surrogate's clip actually takes effect
        low, high = low & (A < 0), high & (A > 0)
    # Per-completion clip fractions (a completion is a sample of the row).
    per_sample = torch.zeros(max(row.num_samples, 1), device=r.device)
    trained = per_sample.index_add(0, row.token_sample, torch.ones_like(r))
    low_frac = per_sample.index_add(0, row.token_sample, low.float()) / trained.clamp_min(1)
    high_frac = per_sample.index_add(0, row.token_sample, high.float()) / trained.clamp_min(1)
    has_tokens = trained > 0
    inf = torch.tensor(float("inf"), device=r.device)
    stats = {
        "trained_tokens": torch.tensor(float(r.numel()), device=r.device),
        "is_ratio_sum": r.sum(),
        "is_ratio_min": r.min() if r.numel() else inf,
        "is_ratio_max": r.max() if r.numel() else -inf,
        "logp_diff_sum": log_ratio.abs().sum(),
        "logp_diff_max": log_ratio.abs().max() if r.numel() else -inf,
        "masked_tokens": (1 - m).sum(),
        "entropy_sum": logps.entropy.sum(),
        "clip_low_tokens": low.sum().float(),
        "clip_high_tokens": high.sum().float(),
        "clip_region_tokens": (low | high).sum().float(),
        "clip_low_frac_min": low_frac[has_tokens].min() if has_tokens.any() else inf,
        "clip_high_frac_max": high_frac[has_tokens].max() if has_tokens.any() else -inf,
    }
    if cfg.score_centering:  # sampling/sampler_mass is logged only then, as in TRL's AsyncGRPOTrainer
        stats["sampler_mass_sum"] = (row.sampler_topk_logprobs.exp() * row.sampler_topk_valid).sum()  # sum_t Q_H
    return {k: v.detach().float() for k, v in stats.items()}


STAT_REDUCTIONS: dict[str, str] = {
    "trained_tokens": "sum",
    "is_ratio_sum": "sum",
    "is_ratio_min": "min",
    "is_ratio_max": "max",
    "logp_diff_sum": "sum",
    "logp_diff_max": "max",
    "masked_tokens": "sum",
    "sampler_mass_sum": "sum",
    "entropy_sum": "sum",
    "clip_low_tokens": "sum",
    "clip_high_tokens": "sum",
    "clip_region_tokens": "sum",
    "clip_low_frac_min": "min",
    "clip_high_frac_max": "max",
}
"""How each statistic combines across rows, processes, micro-batches and windows (sum / min / max).

Empty rows give the identities (0, +inf for a min, -inf for a max), so they combine harmlessly."""


def reduce_loss_stats(stats: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine the statistics of several rows or micro-batches (per :data:`STAT_REDUCTIONS`)."""
    ops: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"sum": torch.sum, "min": torch.amin, "max": torch.amax}
    stacked: dict[str, list[torch.Tensor]] = {}
    for s in stats:
        for key, value in s.items():
            stacked.setdefault(key, []).append(value)
    return {key: ops[STAT_REDUCTIONS[key]](torch.stack(values)) for key, values in stacked.items()}


def loss_metrics(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The source's metric names (``sampling/*``, ``entropy``, ``clip_ratio/*``) from combined statistics.

    Nothing trained gives an empty dict.
    """
    s = {k: float(v) for k, v in stats.items()}
    n = s["trained_tokens"]
    if n == 0:
        return {}
    return {
        "sampling/importance_sampling_ratio/min": s["is_ratio_min"],
        "sampling/importance_sampling_ratio/mean": s["is_ratio_sum"] / n,
        "sampling/importance_sampling_ratio/max": s["is_ratio_max"],
        "sampling/sampling_logp_difference/mean": s["logp_diff_sum"] / n,
        "sampling/sampling_logp_difference/max": s["logp_diff_max"],
        "sampling/masked_mean": s["masked_tokens"] / n,
        "entropy": s["entropy_sum"] / n,
        "clip_ratio/low_mean": s["clip_low_tokens"] / n,
        "clip_ratio/low_min": s["clip_low_frac_min"],
        "clip_ratio/high_mean": s["clip_high_tokens"] / n,
        "clip_ratio/high_max": s["clip_high_frac_max"],
        "clip_ratio/region_mean": s["clip_region_tokens"] / n,
    } | ({"sampling/sampler_mass": s["sampler_mass_sum"] / n} if "sampler_mass_sum" in s else {})
