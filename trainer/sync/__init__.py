"""Weight synchronisation: the trainer's rank 0 pushes the policy into the vLLM server.

``policy_sync`` (the trainer's side, on every rank), ``weight_sync`` (one sync of the full weights),
``backends/`` (one file per weight-transfer backend, picked by the name the server reports),
``lora_sync`` (adapter-only syncs), ``gather`` (FSDP2 shards) and ``background`` (a sync overlapping
the next step) run in the training process; ``push`` is the one-call form for scripts and tests.
``vllm_plugin`` is loaded by vLLM inside the server process (an entry point of
``vllm.general_plugins``) and registers the engine of ``vllm_engine``, which only vLLM imports.

``from trainer.sync import push_weights``: names are imported on first use, so that vLLM loading
the plugin does not import the trainer's side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.sync.push import push_weights, weight_synchronizer

__all__ = ["push_weights", "weight_synchronizer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("trainer.sync.push"), name)
    raise AttributeError(f"module 'trainer.sync' has no attribute {name!r}")
