"""Mixture-of-Experts load-balancing loss under packing (``router_aux_loss_coef``).

The packed forward (``trainer/training/tree_attention.py``) runs the model with a tree mask, which the
model's own aux-loss code cannot read (it expects a (batch, seq) padding mask), so the trainer
computes the loss itself: :class:`RouterLogits` hooks the model's routers (the modules that
transformers records ``router_logits`` from), and :meth:`RouterLogits.aux_loss` applies the model's
own ``load_balancing_loss_func`` (Switch Transformer, eqs. 4-6) to the row's real tokens only (the
pad token of an empty row does not count). The trainer adds ``coef * aux_loss`` to each row's loss.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.exceptions import ConfigError
from trainer.training.tree_attention import unwrap_model

__all__ = ["RouterLogits", "is_moe", "resolve_aux_loss_coef"]


def _recorder(model: nn.Module) -> Any:
    return getattr(unwrap_model(model), "_can_record_outputs", None) or {}


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` routes tokens to experts (transformers records ``router_logits`` from it)."""
    return "router_logits" in _recorder(model)


def resolve_aux_loss_coef(model: nn.Module, coef: float | None) -> float:
    """The coefficient to use: ``coef``, else the model config's ``router_aux_loss_coef`` (0 for a
    dense model). Raises :class:`ConfigError` when a non-zero ``coef`` is given for a dense model."""
    if not is_moe(model):
        if coef:  # 0.0 only says "no aux loss", which holds
            raise ConfigError(f"router_aux_loss_coef={coef} is set, but {type(unwrap_model(model)).__name__} is "
                              "not a Mixture-of-Experts model; leave it None")
        return 0.0
    if coef is None:
        coef = float(getattr(unwrap_model(model).config, "router_aux_loss_coef", 0.0) or 0.0)
    if coef < 0:
        raise ConfigError(f"router_aux_loss_coef={coef} must be >= 0 (0.0 disables the load-balancing loss)")
    return coef


class RouterLogits:
    """Collects the router logits of each forward of an MoE model (hooks stay for its lifetime).

    Args:
        model: The MoE model (wrappers such as DDP or PEFT are looked through).
    """

    def __init__(self, model: nn.Module) -> None:
        core = unwrap_model(model)
        recorder = _recorder(core)["router_logits"]
        self._index = recorder.index
        self._layers: list[torch.Tensor] = []
        config = core.config
        self.num_experts = int(config.num_experts)
        self.top_k = int(config.num_experts_per_tok)
        self._loss_func: Callable[..., torch.Tensor] = sys.modules[type(core).__module__].load_balancing_loss_func
        routers = [m for m in core.modules() if isinstance(m, recorder.target_class)]
        if not routers:
            raise ConfigError(f"{type(core).__name__}: found no {recorder.target_class.__name__} module to read "
                              "the router logits from")
        config.output_router_logits = False  # the model's own aux loss would misread the tree mask
        self._hooks = [m.register_forward_hook(self._record) for m in routers]

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        self._layers.append(output[self._index] if isinstance(output, (tuple, list)) else output)

    def clear(self) -> None:
        """Forget what earlier forwards recorded (call before each forward)."""
        self._layers = []

    def aux_loss(self, positions: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of the last forward over the tokens at ``positions`` of its flattened
        input (a row's real tokens: :func:`trainer.training.row_forward.forwarded_positions`); 0 when
        there are none. Clears the recorded logits."""
        layers, self._layers = self._layers, []
        if not layers:
            raise RuntimeError("no router logits were recorded: aux_loss() must follow a forward of the model")
        if positions.numel() == 0:
            return layers[0].sum() * 0.0  # keeps the routers in the graph (DDP expects their gradient)
        logits = tuple(layer.reshape(-1, layer.shape[-1])[positions] for layer in layers)
        return self._loss_func(logits, self.num_experts, self.top_k)

    def remove(self) -> None:
        """Remove the hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
