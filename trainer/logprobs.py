"""Trainer log-probabilities of a packed row, computed in chunks through the LM head.

For each trained token t (predicted at row position ``pred_index[t]``) this gives, at the sampling
temperature and renormalised over the token's top-k/top-p candidate set when it has one (SPEC §6):
``log p(target)``, ``log p(v)`` for the sampler's top-K ids v (score centering, SPEC §4), and the
entropy of the distribution. Only the trained positions' hidden states go through the LM head, a
chunk at a time under activation checkpointing: a chunk's (chunk x vocab) logits exist only while
that chunk is computed (forward) or recomputed (backward), never a (tokens x vocab) tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.packing import PackedRow
from trainer.tree_attention import packed_hidden_states, unwrap_model

__all__ = ["DEFAULT_CHUNK_SIZE", "RowLogProbs", "forward_packed", "logprobs_from_hidden"]

DEFAULT_CHUNK_SIZE = 512
"""Trained tokens per LM-head chunk: a 151,936-word vocabulary makes 0.3 GB of float32 logits."""


@dataclass
class RowLogProbs:
    """Trainer log-probs of a row's trained tokens (T of them; K = the row's top-k width).

    ``logp`` and ``topk_logp`` are differentiable; ``topk_logp`` is ``-inf`` for an id outside the
    token's candidate set (probability zero there). ``entropy`` is detached (a metric).
    """

    logp: torch.Tensor  # (T,)
    topk_logp: torch.Tensor  # (T, K)
    entropy: torch.Tensor  # (T,)


def _restrict(logits: torch.Tensor, candidate_ids: torch.Tensor, candidate_valid: torch.Tensor) -> torch.Tensor:
    """Set logits outside each token's candidate set to -inf (tokens without a set keep all)."""
    keep = torch.zeros_like(logits, dtype=torch.bool)  # (C, V)
    keep.scatter_(1, candidate_ids, candidate_valid)
    keep |= ~candidate_valid.any(-1, keepdim=True)
    return logits.masked_fill_(~keep, float("-inf"))


def _chunk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target_ids: torch.Tensor,
    topk_ids: torch.Tensor,
    candidate_ids: torch.Tensor | None,
    candidate_valid: torch.Tensor | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log p(target) (C,), log p(top-k) (C, K) and entropy (C,) of one chunk of C trained tokens."""
    logits = F.linear(hidden, weight, bias).float().div_(temperature)  # (C, V)
    if candidate_ids is not None and candidate_valid is not None:
        logits = _restrict(logits, candidate_ids, candidate_valid)
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)  # (C, 1)
    logp = logits.gather(1, target_ids[:, None]).squeeze(1) - log_z.squeeze(1)  # (C,)
    topk_logp = logits.gather(1, topk_ids) - log_z  # (C, K)
    with torch.no_grad():  # entropy = log Z - sum_v p_v logit_v, with one (C, V) temporary
        p_logits = torch.softmax(logits, dim=-1).mul_(logits).nan_to_num_(nan=0.0)  # 0 * -inf -> 0
        entropy = log_z.squeeze(1) - p_logits.sum(-1)  # (C,)
    return logp, topk_logp, entropy


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    row: PackedRow,
    temperature: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> RowLogProbs:
    """Log-probs of ``row``'s trained tokens from the decoder's final hidden states.

    Args:
        hidden: Final hidden states of the row, (N, D).
        lm_head: The output projection (``weight`` (V, D), optional ``bias``; LoRA on it is refused).
        row: The packed row (same device as ``hidden``).
        temperature: Sampling temperature (logits are divided by it).
        chunk_size: Trained tokens per LM-head chunk.

    Returns:
        The row's :class:`RowLogProbs`. With no trained token the tensors are empty but still
        depend on ``hidden``, so a backward reaches every parameter (with zero gradient).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not isinstance(lm_head, nn.Linear):  # e.g. a LoRA-wrapped head: its adapter would be ignored
        raise TypeError(f"the LM head must be a plain nn.Linear, got {type(lm_head).__name__}")
    h = hidden[row.pred_index]  # (T, D): the positions that predict trained tokens
    bias = getattr(lm_head, "bias", None)
    cand_ids, cand_valid = row.candidate_ids, row.candidate_valid
    pieces = []
    for start in range(0, max(row.num_trained, 1), chunk_size):
        sl = slice(start, start + chunk_size)
        pieces.append(
            checkpoint(
                _chunk_logprobs,
                h[sl],
                lm_head.weight,
                bias,
                row.target_ids[sl],
                row.sampler_topk_ids[sl],
                cand_ids[sl] if cand_ids is not None else None,
                cand_valid[sl] if cand_valid is not None else None,
                temperature,
                use_reentrant=False,
            )
        )
    logp, topk_logp, entropy = (torch.cat(parts) for parts in zip(*pieces, strict=True))
    return RowLogProbs(logp=logp, topk_logp=topk_logp, entropy=entropy)


def forward_packed(
    model: nn.Module, row: PackedRow, temperature: float, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> RowLogProbs:
    """Forward a packed row through ``model`` (tree attention) and return its trained tokens' log-probs.

    Args:
        model: A causal LM switched to tree attention (:func:`trainer.tree_attention.enable_tree_attention`),
            possibly wrapped (DDP, PEFT): it is called as a whole, so gradient synchronisation works.
        row: The packed row, on the model's device.
        temperature: Sampling temperature.
        chunk_size: Trained tokens per LM-head chunk.
    """
    hidden = packed_hidden_states(model, row)  # (N, D)
    return logprobs_from_hidden(hidden, unwrap_model(model).get_output_embeddings(), row, temperature, chunk_size)
