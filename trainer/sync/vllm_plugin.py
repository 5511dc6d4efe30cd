"""Server side of toolgym's CPU weight-transfer backend, loaded by vLLM as a plugin.

vLLM's built-in weight-transfer backends (``nccl``, ``ipc``) need CUDA. This backend lets a
trainer drive vLLM's standard sequence (``/init_weight_transfer_engine`` -> ``/start_weight_update``
-> ``/update_weights`` -> ``/finish_weight_update``) on a CPU server: the trainer writes each chunk
of tensors as a safetensors file in shared memory (``/dev/shm`` when present) and sends only its
path, names, dtypes and shapes in the JSON body; the server memory-maps the file and loads the
tensors through the model's own ``load_weights`` (checkpoint-format names, so fused layers are
handled by vLLM).

Registered through the ``vllm.general_plugins`` entry point in ``pyproject.toml``; start the
server with ``--weight-transfer-config '{"backend": "toolgym_shm"}'``. This module is imported by
vLLM processes only: nothing else in toolgym imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BACKEND_NAME = "toolgym_shm"


def register() -> None:
    """vLLM plugin hook: register the ``toolgym_shm`` weight-transfer engine (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, _engine_class())


def _engine_class() -> type:
    # Built lazily: the base classes live in vllm, which only the server process has.
    import torch
    from safetensors import safe_open
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    @dataclass
    class SharedMemoryInitInfo(WeightTransferInitInfo):
        """Handshake data: the wire-format version the trainer speaks."""

        protocol_version: int = 1

    @dataclass
    class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
        """One chunk: a safetensors file and what the trainer says it holds."""

        path: str
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

    class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
        """Receives checkpoint-format tensors from safetensors files in shared memory."""

        init_info_cls = SharedMemoryInitInfo
        update_info_cls = SharedMemoryUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
            if init_info.protocol_version != 1:
                raise ValueError(
                    f"toolgym_shm: trainer speaks protocol {init_info.protocol_version}, "
                    "this server speaks 1; install the same toolgym on both sides"
                )

        def start_weight_update(self) -> None:
            self._aliases = _shared_parameters(self.model)
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]  # (*args) shim
            _restore_shared_parameters(self._aliases)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(), which raises on CPU;
            # loading here is synchronous, so there is nothing to wait for.
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
            weights: list[tuple[str, torch.Tensor]] = []
            with safe_open(update_info.path, framework="pt") as f:
                present = set(f.keys())
                for name, dtype_name, shape in zip(
                    update_info.names, update_info.dtype_names, update_info.shapes, strict=True
                ):
                    if name not in present:
                        raise ValueError(f"toolgym_shm: tensor {name!r} is missing from {update_info.path}")
                    tensor = f.get_tensor(name)
                    if list(tensor.shape) != list(shape) or str(tensor.dtype).split(".")[-1] != dtype_name:
                        raise ValueError(
                            f"toolgym_shm: tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, "
                            f"the request says {dtype_name}{list(shape)}"
                        )
                    weights.append((name, tensor))
            self.model.load_weights(weights)  # type: ignore[operator]  # on every vLLM model class, not on nn.Module

        def shutdown(self) -> None:
            pass

    return SharedMemoryWeightTransferEngine


_Alias = tuple[Any, list[tuple[Any, str]]]


def _shared_parameters(model: Any) -> list[_Alias]:
    """Parameters held by several modules (tied embeddings): ``(tensor, [(module, attr), ...])``."""
    holders: dict[int, _Alias] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), (param, []))[1].append((module, attr))
    return [entry for entry in holders.values() if len(entry[1]) > 1]


def _restore_shared_parameters(aliases: list[_Alias]) -> None:
    # Layerwise reload only post-processes a module that received checkpoint tensors. A tied
    # lm_head receives none (its tensor arrives as embed_tokens), so on CPU it would keep the
    # gemm weights it pre-packed from the old values: re-tie it and re-run its processing.
    for old, holders in aliases:
        fresh = [getattr(m, a) for m, a in holders if getattr(m, a) is not old]
        for module, attr in holders:
            if fresh:
                setattr(module, attr, fresh[0])
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)
