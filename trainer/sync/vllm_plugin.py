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
server with ``--weight-transfer-config '{"backend": "toolgym_shm"}'``. Its engine is built in vLLM
processes only; the trainer side (:mod:`trainer.sync.weight_sync`) imports just its constants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BACKEND_NAME = "toolgym_shm"
PROTOCOL_VERSION = 2  # 2: whole updates in one call


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
        """One chunk: a safetensors file and what the trainer says it holds. With ``whole_update``
        the call carries the rest of the update in ``more_chunks`` (same fields) and finishes the
        reload itself."""

        path: str
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        more_chunks: list[dict[str, Any]] = field(default_factory=list)
        whole_update: bool = False

    class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
        """Receives checkpoint-format tensors from safetensors files in shared memory."""

        init_info_cls = SharedMemoryInitInfo
        update_info_cls = SharedMemoryUpdateInfo
        supports_draft_weight_update = False
        _reloading = False  # a layerwise reload is under way (between its first chunk and its end)

        def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
            if init_info.protocol_version != PROTOCOL_VERSION:
                raise ValueError(
                    f"toolgym_shm: trainer speaks protocol {init_info.protocol_version}, "
                    f"this server speaks {PROTOCOL_VERSION}; install the same toolgym on both sides"
                )

        def start_weight_update(self) -> None:
            # The reload begins with the first chunk (_begin_reload), not here: between this call
            # and a whole update the engine keeps stepping, and it must step on a whole model.
            self._reloading = False

        def finish_weight_update(self) -> None:
            self._end_reload()

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(), which raises on CPU;
            # loading here is synchronous, so there is nothing to wait for.
            info = self.parse_update_info(update_info)
            self._begin_reload()
            self.receive_weights(info)
            for chunk in info.more_chunks:
                self.receive_weights(self.parse_update_info(chunk))
            if info.whole_update:
                self._end_reload()

        def _begin_reload(self) -> None:
            if not self._reloading:
                self._aliases = _shared_parameters(self.model)
                initialize_layerwise_reload(self.model)
                self._reloading = True

        def _end_reload(self) -> None:
            if self._reloading:
                finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]  # (*args) shim
                _restore_shared_parameters(self._aliases)
                self._reloading = False

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
