"""The step guard: an optimizer step whose gradients are not finite is never applied.

One ``inf`` or ``nan`` (a reward, a log-prob of a token the model gives probability 0, an overflow)
turns the loss and every gradient it reaches non-finite; AdamW would then write ``nan`` into every
weight it touches, and the next weight sync would send them to the vLLM server. :class:`StepGuard`
runs between the gradient clip and ``optimizer.step()``: when any gradient of the step is not finite
on any process, it drops every gradient (AdamW leaves a parameter without one untouched: no update,
no moment change, no weight decay), counts the step and warns. The trainer skips that step's weight
sync. Steps skipped ``max_in_a_row`` times in a row mean training cannot go on: the run stops with
:class:`~trainer.exceptions.NonFiniteTrainingError` instead of spinning on unchanged weights.
"""

from __future__ import annotations

import logging

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
