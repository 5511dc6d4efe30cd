"""Full tensors from a sharded (FSDP2) model, gathered a few at a time and streamed to the server.

Under FSDP2 each rank holds a shard of every parameter (a ``DTensor``); the server needs full
tensors by checkpoint name. :class:`PolicyWeights` is what the weight sync sends instead of a list:

* its :meth:`~PolicyWeights.meta` gives every tensor's name, full shape and dtype without gathering
  anything (``DTensor.shape`` is the global shape), so the served checkpoint is checked *before*
  ``/start_weight_update``;
* iterating it gathers one parameter at a time (``DTensor.full_tensor()``, a collective every rank
  joins) and yields it; the sender holds at most one chunk (``SharedMemorySender.chunk_bytes``) of
  full tensors before writing it out, so no rank ever holds the whole model gathered.

Every rank iterates the same sequence (the gathers are collectives): rank 0 inside the weight sync,
the others through :meth:`~PolicyWeights.drain`. Without sharding the same object yields the
parameters themselves, and only rank 0 needs to iterate.

A PEFT LoRA model yields its merged weights (base + the adapter's delta, computed out of place, see
:func:`trainer.sync.weight_sync.merged_lora_weights` for why), one LoRA layer at a time;
:func:`adapter_state_dict` gathers only the adapter's own tensors, for the adapter-only sync.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import revert_weight_conversion

from trainer.exceptions import WeightSyncError

__all__ = ["PolicyWeights", "adapter_state_dict", "checkpoint_tensors", "full_tensor", "is_sharded"]

NamedTensor = tuple[str, torch.Tensor]


def checkpoint_tensors(model: Any, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One parameter of ``model`` as the checkpoint spells it: the names vLLM's loader maps.

    transformers 5 fuses some checkpoint tensors when it loads them (a MoE layer's experts become one
    ``experts.gate_up_proj`` and one ``experts.down_proj``); its own save path splits them back, and so
    does this, one parameter at a time (meta tensors too). Other parameters come back unchanged.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the transformers model
    return list(revert_weight_conversion(base, {name: tensor}).items())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` gathered from every rank when it is a DTensor shard (a collective), else ``t`` detached."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor shard (FSDP2 prepared it): then every rank
    joins each sync's gathers."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _served_name(name: str) -> str:
    """A PEFT parameter name as the base checkpoint spells it."""
    return name.replace("base_model.model.", "", 1).replace(".base_layer", "")


def _lora_delta(module: Any, adapters: list[str], name: str) -> torch.Tensor:
    """The active adapters' delta of one LoRA layer: PEFT's own (any layer type) when unsharded; from
    the gathered A and B weights of a ``Linear`` layer when sharded (PEFT's reads the shards)."""
    from peft.utils.other import transpose
    from torch.distributed.tensor import DTensor

    sharded = isinstance(module.lora_A[adapters[0]].weight, DTensor)
    if sharded and not isinstance(module.base_layer, nn.Linear):
        raise WeightSyncError(f"{name}: the sharded merged sync supports LoRA on nn.Linear layers only, "
                              f"not {type(module.base_layer).__name__}")
    parts = []
    for a in adapters:
        if sharded:
            b_a = full_tensor(module.lora_B[a].weight) @ full_tensor(module.lora_A[a].weight)
            parts.append(transpose(b_a, module.fan_in_fan_out) * module.scaling[a])
        else:
            parts.append(module.get_delta_weight(a))
    return torch.stack(parts).sum(0) if len(parts) > 1 else parts[0]


class PolicyWeights:
    """The weights the server serves, by checkpoint name, streamed (see the module docstring).

    Args:
        model: The training model (unwrapped from DDP; FSDP2 keeps the module itself).
        skip: Served names never sent (the frozen vision tower, which the server keeps).
    """

    def __init__(self, model: nn.Module, skip: set[str] | frozenset[str] = frozenset()) -> None:
        self.model = model
        self.skip = skip
        self.is_lora = hasattr(model, "peft_config")

    def _lora_layers(self) -> dict[str, tuple[Any, list[str]]]:
        """``<module>.base_layer.weight`` -> (LoRA layer, its active unmerged adapters)."""
        from peft.tuners.lora import LoraLayer

        out = {}
        for name, module in self.model.named_modules():
            if not isinstance(module, LoraLayer) or module.merged:
                continue
            adapters = [a for a in module.active_adapters if a in module.scaling]
            if any(module.use_dora.get(a, False) for a in adapters):
                raise WeightSyncError(f"{name}: DoRA adapters are not supported by the merged-weight sync")
            if adapters:
                out[f"{name}.base_layer.weight"] = (module, adapters)
        return out

    def _params(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(model name, served name, parameter) of every tensor sent."""
        for name, param in self.model.named_parameters():
            served = _served_name(name) if self.is_lora else name
            if not (self.is_lora and "lora_" in name) and served not in self.skip:
                yield name, served, param

    def meta(self) -> list[NamedTensor]:
        """Every tensor that will be sent, as a meta tensor of its full shape and dtype (gathers nothing)."""
        return [pair for _, served, p in self._params()
                for pair in checkpoint_tensors(self.model, served, torch.empty(p.shape, dtype=p.dtype, device="meta"))]

    def __iter__(self) -> Iterator[NamedTensor]:
        """Gather and yield one full tensor at a time (every rank must iterate, in step)."""
        layers = self._lora_layers() if self.is_lora else {}
        with torch.no_grad():
            for name, served, param in self._params():
                weight = full_tensor(param)
                if name in layers:
                    module, adapters = layers[name]
                    weight = weight + _lora_delta(module, adapters, name).to(weight.dtype)
                yield from checkpoint_tensors(self.model, served, weight)  # fused MoE experts split back

    def drain(self) -> None:
        """Take part in every gather without sending anything (the ranks other than 0)."""
        for _ in self:
            pass


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A PEFT model's LoRA tensors gathered in full, by the model's own names (every rank must call
    it; the adapter is small, so it is gathered at once). For ``save_pretrained(state_dict=...)``."""
    with torch.no_grad():
        return {n: full_tensor(p) for n, p in model.named_parameters() if "lora_" in n}
