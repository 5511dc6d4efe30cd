"""toolgym's asynchronous GRPO trainer.

``from trainer import AsyncGRPOTrainer, AsyncGRPOConfig``. Names are imported lazily (on first
attribute access) so that lightweight modules (the vLLM plugin inside the server, the packer on a
GPU image) do not pull in the whole stack; the ``TYPE_CHECKING`` block lets type checkers and IDEs
resolve them.

Layout (docs/architecture.md): this package's top holds the public API and what both processes
share (config, records, exceptions, metrics, rewards, reporting); ``trainer.rollout`` runs in the
spawned rollout worker, ``trainer.training`` in the training process(es), ``trainer.sync`` pushes
weights into the vLLM server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.async_grpo_trainer import AsyncGRPOTrainer
    from trainer.config import AsyncGRPOConfig
    from trainer.exceptions import TrainerError
    from trainer.harness_trainer import HarnessAsyncGRPOConfig, HarnessAsyncGRPOTrainer
    from trainer.records import Rollout, RolloutGroup, TrainingSample, TrainingSequence, TurnRecord
    from trainer.rollout.loop import AsyncRolloutLoop

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "AsyncRolloutLoop",
    "HarnessAsyncGRPOConfig",
    "HarnessAsyncGRPOTrainer",
    "Rollout",
    "RolloutGroup",
    "TrainerError",
    "TrainingSample",
    "TrainingSequence",
    "TurnRecord",
]

_LAZY = {
    "AsyncGRPOConfig": "trainer.config",
    "AsyncGRPOTrainer": "trainer.async_grpo_trainer",
    "AsyncRolloutLoop": "trainer.rollout.loop",
    "HarnessAsyncGRPOConfig": "trainer.harness_trainer",
    "HarnessAsyncGRPOTrainer": "trainer.harness_trainer",
    "Rollout": "trainer.records",
    "RolloutGroup": "trainer.records",
    "TrainerError": "trainer.exceptions",
    "TrainingSample": "trainer.records",
    "TrainingSequence": "trainer.records",
    "TurnRecord": "trainer.records",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
