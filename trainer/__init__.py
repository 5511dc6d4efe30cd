"""toolgym's asynchronous GRPO trainer.

``from trainer import AsyncGRPOTrainer, AsyncGRPOConfig``. Names are imported lazily so that
lightweight modules (the vLLM plugin, the packer on a GPU image) do not pull in the whole stack.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer"]

_LAZY = {"AsyncGRPOConfig": "trainer.config", "AsyncGRPOTrainer": "trainer.async_grpo_trainer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
