"""The forward of a row: tree-packed through tree attention, or each sample on its own (``packing="per_sample"``).

With tree packing (the default, ``docs/packing.md``) a row is a prefix trie forwarded as one sequence, and every
layer reads the trie's layout (:func:`trainer.training.tree_attention.packed_hidden_states`). Layers that
cannot (Mamba2 and other state-space layers, short convolutions, attention sinks) are refused there;
such a model trains with ``AsyncGRPOConfig(packing="per_sample")``: rows share nothing (each sample is
its own segment) and are forwarded as a right-padded batch, one sample per batch entry, by the model's
own layers. Right padding is exact for any causal model (a padding token comes after every real one),
so each sample's hidden states are those of the sample forwarded alone, whatever its layers are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.training.packing import PackedRow
from trainer.training.tree_attention import (
    TREE_ATTENTION,
    decoder_hidden_states,
    packed_hidden_states,
    unwrap_model,
)

__all__ = ["SampleBatchLayout", "forwarded_positions", "per_sample_hidden_states", "row_hidden_states",
           "uses_tree_attention"]


def uses_tree_attention(model: nn.Module) -> bool:
    """Whether ``model`` was switched to tree attention (``enable_tree_attention``)."""
    return bool(unwrap_model(model).config._attn_implementation == TREE_ATTENTION)


@dataclass(frozen=True)
class SampleBatchLayout:
    """Where the tokens of a row without shared prefixes go in a right-padded (B, L) batch of its samples."""

    batch_size: int  # B: samples (segments) of the row
    length: int  # L: the longest sample
    flat_index: torch.Tensor  # (N,) int64: row token i sits at [flat_index[i] // L, flat_index[i] % L]

    @classmethod
    def of(cls, row: PackedRow) -> SampleBatchLayout:
        """The layout of ``row``, which must share nothing (built with ``share_prefixes=False``).

        Such a row is its samples one after another, each a chain whose depths (``position_ids``)
        count 0, 1, 2, ...: a sample starts wherever the depth is 0.
        """
        if row.num_unique_tokens != row.num_unpacked_tokens:
            raise ValueError("a row that shares prefixes needs tree attention: build it with share_prefixes=False "
                             "for a per-sample forward")
        starts = row.position_ids == 0  # (N,)
        sample = starts.cumsum(0) - 1  # (N,) sample of each token
        batch_size, length = int(starts.sum()), int(row.position_ids.max()) + 1
        return cls(batch_size, length, sample * length + row.position_ids)


def per_sample_hidden_states(model: nn.Module, row: PackedRow) -> torch.Tensor:
    """Final hidden states (N, D) of a row without shared prefixes, each sample forwarded on its own.

    One call of ``model`` (so DDP sees one forward) on the right-padded batch of the row's samples,
    with their padding mask; the model keeps its own attention implementation and layers.
    """
    layout = SampleBatchLayout.of(row)
    size = layout.batch_size * layout.length
    device = row.input_ids.device
    input_ids = torch.zeros(size, dtype=torch.long, device=device).index_copy_(0, layout.flat_index, row.input_ids)
    mask = torch.zeros(size, dtype=torch.long, device=device).index_fill_(0, layout.flat_index, 1)
    positions = torch.arange(layout.length, device=device).expand(layout.batch_size, -1)  # (B, L)
    shape = (layout.batch_size, layout.length)
    hidden = decoder_hidden_states(model, input_ids.view(shape), positions, mask.view(shape))  # (B, L, D)
    return hidden.reshape(size, hidden.shape[-1])[layout.flat_index]  # (N, D)


def row_hidden_states(model: nn.Module, row: PackedRow) -> torch.Tensor:
    """Final hidden states (N, D) of ``row``: tree attention when the model was switched to it, else
    :func:`per_sample_hidden_states` (the row must then share nothing)."""
    if uses_tree_attention(model):
        return packed_hidden_states(model, row)
    return per_sample_hidden_states(model, row)


def forwarded_positions(model: nn.Module, row: PackedRow) -> torch.Tensor:
    """Positions of the row's real tokens in its forward, flattened (what per-token hooks, such as the
    MoE routers', see): the first ``num_unique_tokens`` with tree attention, else the samples' places
    in the padded batch."""
    if uses_tree_attention(model):
        return torch.arange(row.num_unique_tokens, device=row.input_ids.device)
    return SampleBatchLayout.of(row).flat_index[: row.num_unique_tokens]
