"""The step guards: an optimizer step whose gradients are not finite is never applied, and one whose
gradient norm spikes far above the recent steps' is scaled down to a bound.

One ``inf`` or ``nan`` (a reward, a log-prob of a token the model gives probability 0, an overflow)
turns the loss and every gradient it reaches non-finite; AdamW would then write ``nan`` into every
weight it touches, and the next weight sync would send them to the vLLM server. :class:`StepGuard`
runs between the gradient clip and ``optimizer.step()``: when any gradient of the step is not finite
on any process, it drops every gradient (AdamW leaves a parameter without one untouched: no update,
no moment change, no weight decay), counts the step and warns. The trainer skips that step's weight
sync. Steps skipped ``max_in_a_row`` times in a row mean training cannot go on: the run stops with
:class:`~trainer.exceptions.NonFiniteTrainingError` instead of spinning on unchanged weights.

:class:`SpikeClip` runs right after it (``grad_spike_clip``): a gradient whose norm is over ``factor``
times the median norm of the last ``WINDOW`` steps is scaled down to that bound. ``max_grad_norm``
is an absolute bound that RL steps rarely reach (norms of 0.02-0.2 in the demo against its 1.0); a
spike of five times the recent norm is written into AdamW's first moment for about ten steps
(``beta1=0.9``) and into its second for hundreds, so one step's outlier steers the next ones.
The bound follows the run's own scale, as pretraining runs clip loss spikes (docs/loss.md).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

import torch
import torch.distributed as dist
from torch import nn

from trainer.exceptions import NonFiniteTrainingError

logger = logging.getLogger(__name__)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The part of a gradient this process holds (an FSDP2 shard is a DTensor)."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


class StepGuard:
    """Drops a step's gradients when any of them is not finite (see the module docstring).

    Args:
        max_in_a_row: Consecutive skipped steps after which the run stops.
    """

    def __init__(self, max_in_a_row: int = 8) -> None:
        self.max_in_a_row = max_in_a_row
        self.skipped_in_a_row = 0

    def check(self, model: nn.Module, step: int) -> bool:
        """Whether the step about to be applied is skipped; if so, its gradients are gone.

        Collective when ``torch.distributed`` is initialised: every process must call it at the same step.
        """
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        bad = (~finite).to(device=device, dtype=torch.int32)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # FSDP shards differ: one bad shard skips every rank
        if not bad.item():
            self.skipped_in_a_row = 0
            return False
        for p in model.parameters():
            p.grad = None
        self.skipped_in_a_row += 1
        logger.warning("step %d: the loss or a gradient is not finite (inf or nan); the step is skipped: the "
                       "weights and the optimizer state stay as they were and nothing is synced "
                       "(batch/skipped_nonfinite_step_count)", step)
        if self.skipped_in_a_row >= self.max_in_a_row:
            raise NonFiniteTrainingError(
                f"{self.skipped_in_a_row} optimizer steps in a row had non-finite gradients (last: step {step}); "
                "the weights are unchanged since the last good step. Look for rewards or advantages that are "
                "inf or nan, or lower the learning rate")
        return True


class SpikeClip:
    """Scales a step's gradients down to ``factor`` times the median norm of the previous steps.

    Args:
        factor: The bound as a multiple of the recent median norm.
        window: How many previous steps' norms the median is taken over; no clip before ``min_steps``.
        min_steps: Steps recorded before the bound applies (the first steps' norms set the scale).
    """

    WINDOW = 16
    MIN_STEPS = 4

    def __init__(self, factor: float, window: int = WINDOW, min_steps: int = MIN_STEPS) -> None:
        self.factor = factor
        self.min_steps = min_steps
        self.norms: deque[float] = deque(maxlen=window)

    def bound(self) -> float:
        """The norm a gradient is clipped to now (``inf`` until ``min_steps`` norms are recorded)."""
        if len(self.norms) < self.min_steps:
            return float("inf")
        return self.factor * statistics.median(self.norms)

    def clip(self, model: nn.Module) -> tuple[float, float]:
        """Clip the model's gradients in place; returns (their norm before, the bound used).

        The norm is recorded as it was (a spike raises the median by one place at most). Collective
        with FSDP2 (the norm of sharded gradients is a reduction): every process calls it at each step.
        """
        params = [p for p in model.parameters() if p.grad is not None]
        norm = _total_norm(params)
        bound = self.bound()
        if norm > bound:
            for p in params:
                assert p.grad is not None
                p.grad.mul_(bound / norm)  # a Python scale: works on plain and FSDP2 (DTensor) gradients alike
        self.norms.append(norm)
        return norm, bound


def _total_norm(params: list[nn.Parameter]) -> float:
    """The 2-norm of all the gradients, each reduced over its own device mesh when FSDP2 shards it
    (parameters on different meshes cannot share one ``clip_grad_norm_``)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        assert p.grad is not None
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        full_tensor = getattr(norm, "full_tensor", None)
        norms.append(full_tensor() if callable(full_tensor) else norm)
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
