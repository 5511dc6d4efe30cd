"""The chunked gated delta rule on variable-length segments: its kernels, and which one runs where.

Two kernels compute the same function (:data:`DeltaRule`: segments given by ``cu_seqlens``, each
from its own initial state, returning each segment's final state):

* transformers' torch reference (any device; the correctness reference of the other);
* flash-linear-attention's (PyPI ``fla-core``) Triton kernels (CUDA), one varlen call.

fla-core 0.6.0 refuses its gated backward on Hopper with Triton >= 3.4.0 and < 3.7.1: a Triton
code-generation bug corrupts ``dk`` in one of its backward kernels there (fla issue #640, traced by
its authors to key tiles of 64; head dims of 128, the Qwen3.5 / Qwen3-Next ones, run key tiles of 128
on Hopper). Its guard covers the whole version range. Here, where the guard applies, fla's backward is
*checked on the device it runs on* before it is used: :func:`fla_backward_error` runs fla's rule
(backward with the guard lifted) and the torch rule in float32 on the same random segments, with the
layer's head dims and dtype, and fla trains only when every gradient agrees within
:data:`FLA_TOLERANCE`; else training takes the torch rule. The lift is scoped to the backward of the
calls this module makes (:class:`_GuardLiftedRule`); nothing else in the process sees it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as _hub_chunk_rule

__all__ = [
    "FLA_TOLERANCE", "DeltaRule", "delta_rule_for", "fla_backward_error", "fla_usable", "rule_error",
    "select_delta_rule", "torch_varlen_rule",
]

DeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``(q, k, v, g, beta, initial_state, cu_seqlens, max_len) -> (out, final_state)``: q, k (N, H, K)
not yet L2-normalised, v (N, H, V), g and beta (N, H), initial_state (S, H, K, V) float32, cu_seqlens
(S + 1,); out (N, H, V), final_state (S, H, K, V)."""

FLA_TOLERANCE = 3e-2
"""Largest relative error (‖fla − torch‖ / ‖torch‖, per gradient) at which fla's lifted backward is used.
bf16 inputs give 1e-3..1e-2 (rounding); the bug of fla #640 gives errors of order 1."""

# transformers wraps its torch reference so that it calls fla instead whenever fla is importable (seen on
# the H200: the "torch" path then hit fla's Hopper backward guard); the torch path must be the torch code.
_torch_chunk_rule = inspect.unwrap(_hub_chunk_rule)


def torch_varlen_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' torch chunked rule on variable-length segments, padded into one batch.

    Padding tokens carry q = k = v = 0, beta = 0 and log-decay 0, so the state passes them unchanged
    and each segment's final state is exact.
    """
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # (S,)
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < lengths[:, None]  # (S, L)
    idx = torch.where(valid, cu_seqlens[:-1, None] + pos[None, :], q.shape[0])  # (S, L); T = padding
    pad = [torch.cat([t, t.new_zeros(1, *t.shape[1:])])[idx] for t in (q, k, v, g, beta)]
    out, final = _torch_chunk_rule(
        *pad[:3], g=pad[3], beta=pad[4], initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # (S, L, H, V), (S, H, K, V)
    return out[valid], final


@functools.cache  # asked at every call of every Gated DeltaNet layer
def _fla_installed() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _fla_guard_applies() -> bool:
    """Whether fla-core refuses its gated backward here (Hopper, 3.4.0 <= Triton < 3.7.1)."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


@contextlib.contextmanager
def _fla_guard_lifted() -> Iterator[None]:
    from fla.ops.common import chunk_o

    saved = chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        yield
    finally:
        chunk_o.TRITON_ABOVE_3_7_1 = saved


@functools.cache
def _guard_lifted_function() -> tuple[Any, inspect.Signature]:
    """fla's autograd function with its backward run under :func:`_fla_guard_lifted` (same saved
    tensors, so gradient checkpointing frees them as it frees fla's own), and its forward's signature."""
    from fla.ops.gated_delta_rule.chunk import ChunkGatedDeltaRuleFunction

    class _GuardLiftedRule(ChunkGatedDeltaRuleFunction):  # type: ignore[misc]
        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> Any:
            with _fla_guard_lifted():
                return ChunkGatedDeltaRuleFunction.backward(ctx, *grads)

    return _GuardLiftedRule, inspect.signature(inspect.unwrap(_GuardLiftedRule.forward))


def _fla_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, lift_guard: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    kwargs: dict[str, Any] = {
        "q": q[None], "k": k[None], "v": v[None], "g": g[None], "beta": beta[None], "scale": k.shape[-1] ** -0.5,
        "initial_state": initial_state, "output_final_state": True, "cu_seqlens": cu_seqlens,
        "use_qk_l2norm_in_kernel": True,
    }
    if lift_guard:
        function, signature = _guard_lifted_function()
        # By name, so that a reordered signature in another fla release cannot shift the arguments.
        bound = signature.bind_partial(None, **kwargs)
        bound.apply_defaults()
        out, final = function.apply(*bound.args[1:])
    else:
        out, final = chunk_gated_delta_rule(**kwargs)
    return out[0], final


def fla_varlen_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked rule, one varlen call with per-segment initial states (fla's guard kept)."""
    return _fla_varlen(q, k, v, g, beta, initial_state, cu_seqlens, lift_guard=False)


def _fla_lifted_varlen_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fla_varlen(q, k, v, g, beta, initial_state, cu_seqlens, lift_guard=True)


def _check_problem(
    device: torch.device, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype, seed: int,
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """Random segments (partial chunks, a segment longer than two chunks), their inputs and two
    random cotangents (of the outputs and of the final states)."""
    gen = torch.Generator(device).manual_seed(seed)
    lengths = [37, 64, 150, 9]
    n, s = sum(lengths), len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    inputs = [
        randn(n, heads, key_dim), randn(n, heads, key_dim), randn(n, heads, value_dim),
        F.logsigmoid(randn(n, heads) + 3.0), torch.sigmoid(randn(n, heads)),  # decays near 1, like trained ones
    ]
    inputs = [t.to(dtype) for t in inputs] + [0.1 * randn(s, heads, key_dim, value_dim)]
    return inputs, cu, [randn(n, heads, value_dim), randn(s, heads, key_dim, value_dim)]


def _gradients(rule: DeltaRule, inputs: list[torch.Tensor], cu: torch.Tensor, cotangents: list[torch.Tensor],
               upcast: bool) -> list[torch.Tensor]:
    leaves = [(t.float() if upcast else t).detach().requires_grad_() for t in inputs]
    out, final = rule(*leaves, cu, int((cu[1:] - cu[:-1]).max()))
    torch.autograd.backward([out.float(), final.float()], cotangents)
    return [t.grad.float() for t in leaves if t.grad is not None] + [out.detach().float(), final.detach().float()]


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def rule_error(rule: DeltaRule, device: torch.device, heads: int, key_dim: int, value_dim: int,
               dtype: torch.dtype) -> float:
    """Worst relative error of ``rule``'s outputs and gradients against the torch rule in float32 on the
    same inputs, over two random problems with these head dims and dtype.

    The check's own autograd graphs keep their tensors as they are (identity saved-tensor hooks): it
    runs at a layer's first call, inside the model's gradient-checkpointed forward, whose hooks would
    otherwise count tensors that the recomputation (check cached, not run again) never saves.
    """
    worst = 0.0
    with torch.autograd.graph.saved_tensors_hooks(_keep, _keep), torch.enable_grad():
        for seed in (0, 1):
            inputs, cu, cotangents = _check_problem(device, heads, key_dim, value_dim, dtype, seed)
            got = _gradients(rule, inputs, cu, cotangents, upcast=False)
            want = _gradients(torch_varlen_rule, inputs, cu, cotangents, upcast=True)
            for a, b in zip(got, want, strict=True):
                if not torch.isfinite(a).all():
                    return float("inf")
                worst = max(worst, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    return worst


@functools.cache
def fla_backward_error(device: torch.device, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype) -> float:
    """:func:`rule_error` of fla's rule with its Hopper guard lifted: measured once per process and shape
    (about a second on a GPU after fla's first compilation for the shape)."""
    return rule_error(_fla_lifted_varlen_rule, device, heads, key_dim, value_dim, dtype)


def fla_usable(device: torch.device, needs_grad: bool, heads: int, key_dim: int, value_dim: int,
               dtype: torch.dtype) -> bool:
    """Whether fla's rule is installed and valid on ``device`` for a layer of these head dims and dtype:
    on CUDA; and, where fla refuses its backward (:func:`_fla_guard_applies`) and gradients are needed,
    only if :func:`fla_backward_error` is within :data:`FLA_TOLERANCE` here."""
    if device.type != "cuda" or not _fla_installed():
        return False
    if not needs_grad or not _fla_guard_applies():
        return True
    return fla_backward_error(device, heads, key_dim, value_dim, dtype) <= FLA_TOLERANCE


_BACKENDS = ("auto", "torch", "fla")
_backend = "auto"


def select_delta_rule(backend: str) -> None:
    """Choose the delta-rule kernel for this process.

    ``auto`` (default): fla where :func:`fla_usable`, else transformers' torch rule; ``torch``: always
    the torch rule; ``fla``: always fla, with its own guard (raises where it is not installed or refuses).
    (The torch rule under ``torch.compile`` was tried: right forward, wrong gradients on torch 2.13, so it
    is not offered.)
    """
    global _backend
    if backend not in _BACKENDS:
        raise ValueError(f"unknown delta-rule backend {backend!r}: one of {', '.join(_BACKENDS)}")
    _backend = backend


def delta_rule_for(q: torch.Tensor, v: torch.Tensor) -> DeltaRule:
    """The rule :func:`select_delta_rule` chose, for inputs ``q`` (N, H, K) and ``v`` (N, H, V)."""
    if _backend == "fla":
        return fla_varlen_rule
    if _backend == "torch":
        return torch_varlen_rule
    needs_grad = torch.is_grad_enabled() and q.requires_grad
    if not fla_usable(q.device, needs_grad, q.shape[1], q.shape[-1], v.shape[-1], q.dtype):
        return torch_varlen_rule
    return _fla_lifted_varlen_rule if needs_grad and _fla_guard_applies() else fla_varlen_rule
