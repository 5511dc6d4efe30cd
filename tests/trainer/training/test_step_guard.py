"""The step guard: a step with non-finite gradients is skipped (weights and optimizer state unchanged),
and step after step of them stops the run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.exceptions import NonFiniteTrainingError
from trainer.training.step_guard import SpikeClip, StepGuard


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)


def _backward(model: nn.Module, scale: float) -> None:
    model.zero_grad()
    (model(torch.ones(2, 4)).sum() * scale).backward()


def test_a_finite_step_is_applied() -> None:
    model, opt = _model_and_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, 1.0)
    assert StepGuard().check(model, step=1) is False
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("scale", [float("inf"), float("nan")])
def test_a_non_finite_step_leaves_weights_and_optimizer_state_as_they_were(scale: float) -> None:
    model, opt = _model_and_optimizer()
    _backward(model, 1.0)
    opt.step()  # one good step: the optimizer has moments to keep
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    _backward(model, scale)
    assert StepGuard().check(model, step=2) is True
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters(), strict=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_steps_skipped_in_a_row_stop_the_run_and_a_good_step_resets_the_count() -> None:
    model, _ = _model_and_optimizer()
    guard = StepGuard(max_in_a_row=3)
    for step in (1, 2):
        _backward(model, float("nan"))
        assert guard.check(model, step)
    _backward(model, 1.0)
    assert not guard.check(model, 3)  # a good step in between: the count starts again
    for step in (4, 5):
        _backward(model, float("nan"))
        guard.check(model, step)
    _backward(model, float("nan"))
    with pytest.raises(NonFiniteTrainingError, match="3 optimizer steps in a row had non-finite gradients"):
        guard.check(model, 6)


def test_a_gradient_spike_is_clipped_to_a_multiple_of_the_recent_median_norm() -> None:
    model, _ = _model_and_optimizer()
    clip = SpikeClip(factor=3.0, window=8, min_steps=4)
    for step in range(4):  # the first steps set the scale: never clipped
        _backward(model, 1.0 + 0.1 * step)
        norm, bound = clip.clip(model)
        assert bound == float("inf")
    median = sorted(clip.norms)[1:3]
    expected_bound = 3.0 * (median[0] + median[1]) / 2
    _backward(model, 1.0)
    unspiked = _grad_norm(model)
    norm, bound = clip.clip(model)
    assert bound == pytest.approx(expected_bound) and norm == pytest.approx(unspiked)
    assert _grad_norm(model) == pytest.approx(unspiked)  # under the bound: untouched
    _backward(model, 10.0)  # ten times the usual gradient
    direction = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm, bound = clip.clip(model)
    assert norm == pytest.approx(10 * unspiked, rel=1e-5)
    assert _grad_norm(model) == pytest.approx(bound, rel=1e-5)  # scaled down to the bound
    for before, p in zip(direction, model.parameters(), strict=True):
        assert p.grad is not None
        assert torch.allclose(p.grad, before * bound / norm)  # the same direction
    assert clip.norms[-1] == pytest.approx(norm)  # the spike is recorded as it was


def _grad_norm(model: nn.Module) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                       if p.grad is not None])))
