"""Server side of toolgym's CPU weight-transfer backend, loaded by vLLM as a plugin.

vLLM's built-in weight-transfer backends (``nccl``, ``ipc``) need CUDA. This backend lets a
trainer drive vLLM's standard sequence (``/init_weight_transfer_engine`` -> ``/start_weight_update``
-> ``/update_weights`` -> ``/finish_weight_update``) on a CPU server: the trainer writes each chunk
of tensors as a safetensors file in shared memory (``/dev/shm`` when present) and sends only its
path, names, dtypes and shapes in the JSON body; the server memory-maps the file and loads the
tensors through the model's own ``load_weights`` (checkpoint-format names, so fused layers are
handled by vLLM).

A whole update can also arrive as one ``/update_weights`` call (``whole_update``: the first chunk
plus ``more_chunks``). vLLM's engine runs such a call between two of its steps, and this engine
starts its layerwise reload only with the first chunk it receives, so the model is never seen
half-loaded and the server need not pause for the sync (``weight_sync_pause="none"``).

Registered through the ``vllm.general_plugins`` entry point in ``pyproject.toml``; start the
server with ``--weight-transfer-config '{"backend": "toolgym_shm"}'``. The engine's classes are in
:mod:`trainer.sync.vllm_engine`, which imports vLLM and is imported only by :func:`register`, in
vLLM's processes; the trainer's side (:mod:`trainer.sync.backends.shared_memory`) imports just the
constants here.
"""

from __future__ import annotations

BACKEND_NAME = "toolgym_shm"
PROTOCOL_VERSION = 2  # 2: whole updates in one call


def register() -> None:
    """vLLM plugin hook: register the ``toolgym_shm`` weight-transfer engine (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from trainer.sync.vllm_engine import SharedMemoryWeightTransferEngine

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, SharedMemoryWeightTransferEngine)
