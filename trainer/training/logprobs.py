"""Trainer log-probabilities of a packed row, computed in chunks through the LM head.

For each trained token t (predicted at row position ``pred_index[t]``) this gives, at the sampling
temperature and renormalised over the token's top-k/top-p candidate set when it has one (docs/loss.md):
``log p(target)``, ``log p(v)`` for the sampler's top-K ids v (score centering, docs/loss.md), and the
entropy of the distribution. Only the trained positions' hidden states go through the LM head, a
chunk at a time; never a (tokens x vocab) tensor. Two ways:

* :func:`forward_packed` / :func:`logprobs_from_hidden`: differentiable log-probs for any loss. Each
  chunk runs under activation checkpointing, so its logits exist while it is computed (forward) and
  recomputed (backward): four (chunk x vocab x hidden) matmuls per chunk.
* :func:`head_loss_from_hidden`: for a loss that is a sum of per-token terms with a known divisor
  (the GRPO loss), the gradient of each chunk's logits is formed in the forward, right after its
  softmax, and turned at once into the gradients of the hidden states and of the head: three
  matmuls per chunk, no recomputation; backward only scales the stored gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.training.packing import PackedRow
from trainer.training.row_forward import row_hidden_states
from trainer.training.tree_attention import unwrap_model

__all__ = [
    "DEFAULT_CHUNK_SIZE", "FUSED_CHUNK_SIZE", "RowLogProbs", "TokenLoss", "final_logit_softcap", "forward_packed",
    "head_loss_from_hidden", "logprobs_from_hidden",
]

DEFAULT_CHUNK_SIZE = 512
"""Trained tokens per LM-head chunk of :func:`logprobs_from_hidden`: a 151,936-word vocabulary makes
0.3 GB of float32 logits, and the backward's recomputation of a chunk raises the peak with its size."""

FUSED_CHUNK_SIZE = 1536
"""Trained tokens per LM-head chunk of :func:`head_loss_from_hidden`. Python issues about 30 small
operations per chunk; at 512 the GPU of a compiled Qwen3-0.6B step waited on them (36-45 % HFU over
four runs on one H200, against 45.5-48.9 % at 1,536: ``bench/packing/README.md``). A chunk's bf16
logits and their gradient (2 x 0.47 GB at 151,936 words) live only during the forward, while the
checkpointed activations are small: a 16k-token row's peak grows from 3.67 to 3.84 GiB."""


@dataclass
class RowLogProbs:
    """Trainer log-probs of a row's trained tokens (T of them; K = the row's top-k width).

    ``logp`` and ``topk_logp`` are differentiable; ``topk_logp`` is ``-inf`` for an id outside the
    token's candidate set (probability zero there). ``entropy`` is detached (a metric).
    """

    logp: torch.Tensor  # (T,)
    topk_logp: torch.Tensor  # (T, K)
    entropy: torch.Tensor  # (T,)


def final_logit_softcap(model: nn.Module) -> float | None:
    """The model's final-logit soft-cap (``final_logit_softcapping``, Gemma 2), or ``None``.

    The chunked head computes the logits itself, bypassing the model's own head code, so it applies
    the cap (``cap * tanh(logits / cap)``, before the temperature) as the model and the sampler do.
    """
    cap = getattr(unwrap_model(model).config.get_text_config(), "final_logit_softcapping", None)
    return float(cap) if cap else None


def _excluded(logits: torch.Tensor, candidate_ids: torch.Tensor, candidate_valid: torch.Tensor) -> torch.Tensor:
    """(C, V) bool: True outside each token's candidate set (tokens without a set exclude nothing)."""
    # Padding entries (valid False, id 0 or a repeat) point at a real candidate of their row: a
    # scatter of the validity itself would let a padding entry overwrite a valid one of the same id.
    first = candidate_ids.gather(1, candidate_valid.int().argmax(-1, keepdim=True))  # (C, 1)
    ids = torch.where(candidate_valid, candidate_ids, first)  # (C, M)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)  # (C, V)
    keep |= ~candidate_valid.any(-1, keepdim=True)
    return keep.logical_not_()


def _chunk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target_ids: torch.Tensor,
    topk_ids: torch.Tensor,
    candidate_ids: torch.Tensor | None,
    candidate_valid: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log p(target) (C,), log p(top-k) (C, K) and entropy (C,) of one chunk of C trained tokens."""
    logits = F.linear(hidden, weight, bias).float()  # (C, V)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.div_(temperature)
    if candidate_ids is not None and candidate_valid is not None:
        logits = logits.masked_fill_(_excluded(logits, candidate_ids, candidate_valid), float("-inf"))
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)  # (C, 1)
    logp = logits.gather(1, target_ids[:, None]).squeeze(1) - log_z.squeeze(1)  # (C,)
    topk_logp = logits.gather(1, topk_ids) - log_z  # (C, K)
    with torch.no_grad():  # entropy = log Z - sum_v p_v logit_v, with one (C, V) temporary
        p_logits = torch.softmax(logits, dim=-1).mul_(logits).nan_to_num_(nan=0.0)  # 0 * -inf -> 0
        entropy = log_z.squeeze(1) - p_logits.sum(-1)  # (C,)
    return logp, topk_logp, entropy


def _check_head(lm_head: nn.Module, temperature: float) -> None:
    """Refuse what the chunked head cannot compute: a non-positive temperature, a head that is not a plain Linear."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not isinstance(lm_head, nn.Linear):  # e.g. a LoRA-wrapped head: its adapter would be ignored
        raise TypeError(f"the LM head must be a plain nn.Linear, got {type(lm_head).__name__}")


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    row: PackedRow,
    temperature: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    softcap: float | None = None,
) -> RowLogProbs:
    """Log-probs of ``row``'s trained tokens from the decoder's final hidden states.

    Args:
        hidden: Final hidden states of the row, (N, D).
        lm_head: The output projection (``weight`` (V, D), optional ``bias``; LoRA on it is refused).
        row: The packed row (same device as ``hidden``).
        temperature: Sampling temperature (logits are divided by it).
        chunk_size: Trained tokens per LM-head chunk.
        softcap: Final-logit soft-cap (:func:`final_logit_softcap`), or ``None``.

    Returns:
        The row's :class:`RowLogProbs`. With no trained token the tensors are empty but still
        depend on ``hidden``, so a backward reaches every parameter (with zero gradient).
    """
    _check_head(lm_head, temperature)
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
                softcap,
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
        model: A causal LM switched to tree attention (:func:`trainer.training.tree_attention.enable_tree_attention`),
            possibly wrapped (DDP, PEFT): it is called as a whole, so gradient synchronisation works.
        row: The packed row, on the model's device.
        temperature: Sampling temperature.
        chunk_size: Trained tokens per LM-head chunk.
    """
    hidden = row_hidden_states(model, row)  # (N, D)
    head = unwrap_model(model).get_output_embeddings()
    return logprobs_from_hidden(hidden, head, row, temperature, chunk_size, final_logit_softcap(model))


TokenLoss = Callable[[RowLogProbs, PackedRow], torch.Tensor]
"""Per-token losses (C,) of a chunk of trained tokens, from their log-probs and the row restricted
to them (:meth:`PackedRow.select_trained`). Token t's loss may depend on token t's log-probs only."""


def _add_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` (one fused ``addmm`` when the dtypes agree; ``a @ b`` in autocast's dtype otherwise)."""
    if out.dtype == a.dtype == b.dtype:
        out.addmm_(a, b)
    else:
        out.add_(a @ b)


def _softmax_stats(
    logits: torch.Tensor, excluded: torch.Tensor | None, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log Z (C,) and entropy (C,) of softmax(logits / temperature) over each token's candidates."""
    z = logits.float() / temperature  # (C, V)
    if excluded is not None:
        z = z.masked_fill(excluded, float("-inf"))
    log_z = torch.logsumexp(z, dim=-1)  # (C,)
    p_z = torch.exp(z - log_z[:, None]) * z  # (C, V) p_v z_v
    if excluded is not None:
        p_z = p_z.masked_fill(excluded, 0.0)  # 0 * -inf
    return log_z, log_z - p_z.sum(-1)  # H = log Z - sum_v p_v z_v


def _softmax_grad(
    logits: torch.Tensor, excluded: torch.Tensor | None, log_z: torch.Tensor, g_sum: torch.Tensor, temperature: float
) -> torch.Tensor:
    """-p_v * g_sum (C, V) in the logits' dtype: the part of dL/dlogits that every id v has."""
    grad = torch.exp(logits.float() / temperature - log_z[:, None]) * -g_sum[:, None]  # (C, V)
    if excluded is not None:
        grad = grad.masked_fill(excluded, 0.0)  # the -inf logits have no gradient
    return grad.to(logits.dtype)


_COMPILED: dict[Callable[..., object], Callable[..., object]] = {}
_Fn = TypeVar("_Fn", bound=Callable[..., object])


def _compiled(fn: _Fn, x: torch.Tensor) -> _Fn:
    """``fn`` compiled on CUDA (its (C, V) steps become a few passes over the logits, with no
    float32 (C, V) buffer); eager elsewhere (the CPU tests run the same code)."""
    if not x.is_cuda or torch.compiler.is_compiling():
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return cast(_Fn, _COMPILED[fn])  # torch.compile keeps the signature


def _fused_chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    row: PackedRow,
    temperature: float,
    token_loss: TokenLoss,
    divisor: float,
    softcap: float | None,
) -> tuple[torch.Tensor, RowLogProbs, torch.Tensor]:
    """One chunk of C trained tokens: its summed loss / divisor, its detached log-probs and entropy,
    and the gradient of that loss w.r.t. the chunk's raw logits (C, V), in the logits' dtype."""
    logits = F.linear(h, weight, bias)  # (C, V), the model's dtype
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    excluded = None
    if row.candidate_ids is not None and row.candidate_valid is not None:
        excluded = _excluded(logits, row.candidate_ids, row.candidate_valid)  # (C, V)
    log_z, entropy = _compiled(_softmax_stats, logits)(logits, excluded, temperature)  # (C,), (C,)
    ids = torch.cat([row.target_ids[:, None], row.sampler_topk_ids], dim=1)  # (C, 1 + K): y, then H
    z_ids = logits.gather(1, ids).float() / temperature  # (C, 1 + K)
    if excluded is not None:
        z_ids = z_ids.masked_fill(excluded.gather(1, ids), float("-inf"))
    logp_ids = z_ids - log_z[:, None]  # (C, 1 + K)
    logp, topk_logp = logp_ids[:, 0], logp_ids[:, 1:]
    # dL_t / dlog p by autograd on the chunk's (C,) and (C, K) log-probs: the loss's own code.
    with torch.enable_grad():
        leaf_logp, leaf_topk = logp.detach().requires_grad_(), topk_logp.detach().requires_grad_()
        losses = token_loss(RowLogProbs(leaf_logp, leaf_topk, entropy), row)  # (C,)
        g_y, g_k = torch.autograd.grad(losses.sum(), (leaf_logp, leaf_topk), materialize_grads=True)
    # d log p_v / d z_j = 1[j = v] - p_j and z = logits / temperature, so with g the derivatives
    # by id: dL/dlogit_j = (sum of g at id j - p_j sum g) / temperature.
    g = torch.cat([g_y[:, None], g_k], dim=1) / (divisor * temperature)  # (C, 1 + K)
    g_sum = g.sum(-1)  # (C,)
    grad = _compiled(_softmax_grad, logits)(logits, excluded, log_z, g_sum, temperature)  # (C, V)
    # The ids' own entries, computed in float32 and written once (an id may occur twice: y in H).
    g_at = ((ids[:, :, None] == ids[:, None, :]) * g[:, None, :]).sum(-1)  # (C, 1 + K) g summed by id
    at = g_at - logp_ids.exp() * g_sum[:, None]  # (C, 1 + K); p = 0 where excluded
    if excluded is not None:
        at = at.masked_fill(excluded.gather(1, ids), 0.0)
    grad.scatter_(1, ids, at.to(grad.dtype))
    if softcap is not None:  # through the cap: d(c tanh(x / c))/dx = 1 - tanh(x / c)^2
        grad.mul_(1 - (logits / softcap).square())
    loss = losses.detach().sum() / divisor
    return loss, RowLogProbs(logp, topk_logp, entropy), grad


class _HeadLoss(torch.autograd.Function):
    """The chunked head loss; forward computes the gradients, backward scales them by the incoming one."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,  # FunctionCtx, which declares neither needs_input_grad nor the attributes set here
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        row: PackedRow,
        temperature: float,
        token_loss: TokenLoss,
        divisor: float,
        chunk_size: int,
        softcap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(h) if need_h else None  # (T, D)
        grad_w = torch.zeros_like(weight) if need_w else None  # (V, D)
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None  # (V,)
        loss = torch.zeros((), device=h.device)
        pieces = []
        for start in range(0, row.num_trained, chunk_size):
            sl = slice(start, start + chunk_size)
            loss_c, logps_c, g = _fused_chunk(
                h[sl], weight, bias, row.select_trained(sl), temperature, token_loss, divisor, softcap
            )
            loss += loss_c
            pieces.append((logps_c.logp, logps_c.topk_logp, logps_c.entropy))
            if grad_h is not None:
                grad_h[sl] = g @ weight  # (C, D)
            if grad_w is not None:
                _add_matmul(grad_w, g.T, h[sl])  # (V, D)
            if grad_b is not None:
                grad_b += g.sum(0)
        ctx.grads = (grad_h, grad_w, grad_b)
        if pieces:
            logp, topk_logp, entropy = (torch.cat(parts) for parts in zip(*pieces, strict=True))
        else:
            logp, entropy = h.new_zeros(0, dtype=torch.float32), h.new_zeros(0, dtype=torch.float32)
            topk_logp = h.new_zeros(row.sampler_topk_ids.shape, dtype=torch.float32)
        ctx.mark_non_differentiable(logp, topk_logp, entropy)
        return loss, logp, topk_logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: torch.Tensor, *unused: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:
            raise RuntimeError("the fused head loss stores its gradients once: it cannot be backpropagated twice")
        grads, ctx.grads = ctx.grads, None  # scaled in place and handed over: no second (V, D) buffer
        return (*(g.mul_(grad_loss) if g is not None else None for g in grads), None, None, None, None, None, None)


def head_loss_from_hidden(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    row: PackedRow,
    temperature: float,
    token_loss: TokenLoss,
    divisor: float,
    chunk_size: int = FUSED_CHUNK_SIZE,
    softcap: float | None = None,
) -> tuple[torch.Tensor, RowLogProbs]:
    """``sum_t token_loss_t / divisor`` over ``row``'s trained tokens, its gradient formed in the forward.

    Per chunk: logits, softmax, the log-probs of :func:`logprobs_from_hidden`, the loss terms and
    their derivatives w.r.t. the log-probs (autograd on ``token_loss``, (C,) tensors), then the
    logits' gradient ``dL/dz_j = g_j - p_j sum_v g_v`` (g: the derivatives scattered to their ids)
    and at once the gradient of the chunk's hidden states (``grad @ W``) and of the head
    (``W.grad += grad^T h``, ``b.grad += sum grad``). Three matmuls per trained token instead of
    four, and no logits kept or recomputed. Backward multiplies the stored gradients by the
    incoming one, so scaling the loss afterwards (gradient accumulation, loss scaling) is exact.

    Args:
        hidden: Final hidden states of the row, (N, D).
        lm_head: The output projection (a plain ``nn.Linear``).
        row: The packed row (same device as ``hidden``).
        temperature: Sampling temperature.
        token_loss: The per-token loss (see :data:`TokenLoss`).
        divisor: The loss's normaliser, known before the forward (trained tokens of the micro-batch).
        chunk_size: Trained tokens per LM-head chunk.
        softcap: Final-logit soft-cap (:func:`final_logit_softcap`), or ``None``; the logits'
            gradient then goes through it.

    Returns:
        ``(loss, logps)``: the differentiable scalar loss (backward it once) and the detached
        log-probs and entropy of the trained tokens (for metrics). With no trained token the loss
        is zero and its backward still reaches every parameter (with zero gradient).
    """
    _check_head(lm_head, temperature)
    h = hidden[row.pred_index]  # (T, D): the positions that predict trained tokens
    loss, logp, topk_logp, entropy = _HeadLoss.apply(  # type: ignore[no-untyped-call]  # unannotated in torch
        h, lm_head.weight, lm_head.bias, row, temperature, token_loss, divisor, chunk_size, softcap
    )
    return loss, RowLogProbs(logp=logp, topk_logp=topk_logp, entropy=entropy)
