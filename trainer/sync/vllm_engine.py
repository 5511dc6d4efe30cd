"""The ``toolgym_shm`` weight-transfer engine inside the vLLM server (:mod:`trainer.sync.vllm_plugin`
says how it works and registers it).

Imported only by :func:`trainer.sync.vllm_plugin.register`, in vLLM's processes: its base classes
are vLLM's, which the trainer's process need not have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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

from trainer.sync.vllm_plugin import PROTOCOL_VERSION


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
        """Refuse a trainer that speaks another wire protocol."""
        if init_info.protocol_version != PROTOCOL_VERSION:
            raise ValueError(
                f"toolgym_shm: trainer speaks protocol {init_info.protocol_version}, "
                f"this server speaks {PROTOCOL_VERSION}; install the same toolgym on both sides"
            )

    def start_weight_update(self) -> None:
        """Begin an update (the reload itself begins with its first chunk)."""
        # Not here: between this call and a whole update the engine keeps stepping, and it must
        # step on a whole model.
        self._reloading = False

    def finish_weight_update(self) -> None:
        """End the update's reload (a whole update ended it already)."""
        self._end_reload()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one chunk, or with ``whole_update`` every chunk of the update and finish."""
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
        """Check the chunk's file against what the request says it holds, then load it through the
        model's own ``load_weights`` (checkpoint names: fused layers are vLLM's business)."""
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
        """Nothing to release: every chunk's file belongs to the trainer."""


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
