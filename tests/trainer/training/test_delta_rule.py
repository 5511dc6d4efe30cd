"""The on-device check that decides whether fla's lifted backward trains (``rule_error``), run on CPU
with the torch rule and with a rule whose gradients are wrong."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from trainer.training.delta_rule import FLA_TOLERANCE, rule_error, torch_varlen_rule

CPU = torch.device("cpu")


def test_the_check_passes_the_torch_rule_and_catches_a_wrong_gradient() -> None:
    assert rule_error(torch_varlen_rule, CPU, 2, 16, 8, torch.float32) < 1e-5

    class _ScaledKeyGradient(torch.autograd.Function):  # the shape of fla #640's fault: dk corrupted
        @staticmethod
        def forward(ctx, k: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return k.clone()

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return 1.5 * grad

    def wrong_dk(q, k, v, g, beta, initial_state, cu_seqlens, max_len):  # type: ignore[no-untyped-def]
        return torch_varlen_rule(q, _ScaledKeyGradient.apply(k), v, g, beta, initial_state, cu_seqlens, max_len)

    assert rule_error(wrong_dk, CPU, 2, 16, 8, torch.float32) > FLA_TOLERANCE


def test_the_check_inside_a_checkpointed_forward_leaves_its_recomputation_intact() -> None:
    """The check runs at a layer's first call, which is inside the gradient-checkpointed forward; the
    recomputation in backward finds it cached. Its graphs must not be counted by checkpoint's hooks
    (without the identity hooks in rule_error: "248 vs 76 tensors saved" on a real model)."""
    check = functools.cache(lambda: rule_error(torch_varlen_rule, CPU, 2, 16, 16, torch.float32))
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)

    def layer(x: torch.Tensor) -> torch.Tensor:
        assert check() < 1e-5
        return (x @ w).tanh() @ w

    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    want = torch.autograd.grad(layer(x).sum(), w)[0]
    assert w.grad is not None and torch.allclose(w.grad, want)
