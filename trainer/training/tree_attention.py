"""Tree attention: one attention call per layer over a packed row, as a transformers attention backend.

The mask of a packed row (``trainer.training.packing``) is one interval test on its depth-first layout:
key ``k`` is visible to query ``q`` iff ``dfs_enter[k] <= dfs_enter[q] < dfs_leave[k]`` (``k`` is
``q`` or one of its ancestors in the trie). It runs two ways, with the same mask function:

* CUDA: FlexAttention (compiled) with a :class:`BlockMask` built straight from the intervals in
  O(tokens + blocks²) memory; no tokens x tokens tensor exists anywhere.
* CPU: dense ``scaled_dot_product_attention`` with a boolean mask (FlexAttention refuses backward
  on CPU; rows there are small); explicit scores when the model soft-caps attention logits.

Sliding-window layers (Gemma 2) get their own mask, the tree mask cut to the last ``window``
positions of each query's path (:func:`dense_window_mask`).

:func:`enable_tree_attention` registers the backend under :data:`TREE_ATTENTION` and switches a
model to it, so stock classes (``Qwen3ForCausalLM``, ``LlamaForCausalLM``, ...) run unchanged:
the mask goes in as the model's 4D ``attention_mask``, which transformers passes through to the
attention function as is. :func:`packed_hidden_states` runs the model on a row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface, PreTrainedModel

from trainer.exceptions import UnsupportedModelError
from trainer.training.gated_deltanet import TreeLayout, enable_tree_gated_deltanet, gated_deltanet_modules
from trainer.training.packing import PackedRow

__all__ = [
    "TREE_ATTENTION",
    "UnsupportedModelError",
    "check_softcap_device",
    "check_tree_attention_support",
    "dense_tree_mask",
    "decoder_hidden_states",
    "dense_window_mask",
    "enable_tree_attention",
    "flex_tree_mask",
    "packed_hidden_states",
    "tree_attention_forward",
    "tree_mask",
    "unwrap_model",
]

TREE_ATTENTION = "toolgym_tree"
"""Name of the tree-attention backend in ``transformers.AttentionInterface``."""

FLEX_BLOCK_SIZE = 128
"""Tile size of the FlexAttention block mask (FlexAttention's default)."""


def dense_tree_mask(dfs_enter: torch.Tensor, dfs_leave: torch.Tensor) -> torch.Tensor:
    """The (1, 1, N, N) boolean mask: ``mask[q, k]`` iff ``enter[k] <= enter[q] < leave[k]``."""
    q_enter = dfs_enter[:, None]  # (N, 1)
    visible = (dfs_enter[None, :] <= q_enter) & (q_enter < dfs_leave[None, :])  # (N, N)
    return visible[None, None]


def dense_window_mask(position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """The (1, 1, N, N) boolean sliding-window part: ``mask[q, k]`` iff ``position[q] - position[k] < window``.

    In a packed row the positions are trie depths, so ANDed with the tree mask (which keeps only
    ``k``'s on ``q``'s path) this keeps the last ``window`` tokens of ``q``'s own sequence, as the
    model's sliding-window layers do on that sequence alone.
    """
    return (position_ids[:, None] - position_ids[None, :] < window)[None, None]


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's compressed form of a (Qb, Kb) block matrix: counts (1,1,Qb) and indices (1,1,Qb,Kb)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    # Compiled FlexAttention reads these as contiguous: a transposed input would silently give wrong blocks.
    return counts[None, None].contiguous(), indices[None, None].contiguous()


def flex_tree_mask(
    dfs_enter: torch.Tensor,
    dfs_leave: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> BlockMask:
    """A FlexAttention :class:`BlockMask` for a depth-first row, built from its intervals.

    The layout is pre-order, so ``dfs_enter`` is ``arange(N)`` and the queries that see key ``k``
    are exactly the range ``[k, leave[k])``: the query tiles it touches are contiguous, which gives
    every tile's "partial" and "full" status from a difference array over tiles (no N x N tensor).

    With ``window`` (and the row's ``position_ids``), the mask also hides keys ``window`` or more
    positions up the query's path (a sliding-window layer, :func:`dense_window_mask`). Every tile
    the tree reaches then stays partial, so the mask function runs on all of them.
    """
    n, bs, device = dfs_enter.numel(), FLEX_BLOCK_SIZE, dfs_enter.device
    if not torch.equal(dfs_enter, torch.arange(n, device=device)):
        raise ValueError("flex_tree_mask needs a depth-first (pre-order) layout: dfs_enter == arange(N)")
    nb = (n + bs - 1) // bs
    padded = nb * bs
    # Padding keys (leave 0) are visible to no query, so the mask function never reads out of range.
    leave = torch.cat([dfs_leave, torch.zeros(padded - n, device=device, dtype=dfs_leave.dtype)])

    def tree_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        # enter == arange, so the interval test enter[kv] <= enter[q] < leave[kv] reads one index.
        return (kv_idx <= q_idx) & (q_idx < leave[kv_idx])

    mask_mod = tree_mod
    if window is not None:
        if position_ids is None:
            raise ValueError("flex_tree_mask needs the row's position_ids for a sliding window")
        pos = torch.cat([position_ids, position_ids.new_zeros(padded - n)])

        def window_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return tree_mod(b, h, q_idx, kv_idx) & (pos[q_idx] - pos[kv_idx] < window)

        mask_mod = window_mod

    keys = torch.arange(n, device=device)
    first_tile = keys // bs  # (N,) query tile of the key's first visible query (itself)
    last_tile = (dfs_leave - 1) // bs  # (N,) query tile of its last visible query
    # any[qb, kb]: some key of tile kb is visible to some query of tile qb.
    diff = torch.zeros(nb, nb + 1, dtype=torch.int32, device=device)  # (Kb, Qb + 1)
    ones = torch.ones(n, dtype=torch.int32, device=device)
    diff.index_put_((first_tile, first_tile), ones, accumulate=True)
    diff.index_put_((first_tile, last_tile + 1), -ones, accumulate=True)
    any_visible = diff.cumsum(-1)[:, :nb].T > 0  # (Qb, Kb)
    # full[qb, kb]: every key of tile kb sees every query of tile qb. Tiles holding padding stay
    # partial, so the mask function (which hides padding) runs on them.
    tile_start = torch.arange(nb, device=device) * bs  # (nb,)
    tile_end = torch.clamp(tile_start + bs, max=n)  # (nb,)
    whole = tile_end - tile_start == bs  # (nb,)
    min_leave = torch.full((nb,), padded, dtype=dfs_leave.dtype, device=device)  # (Kb,)
    min_leave.scatter_reduce_(0, first_tile, dfs_leave, reduce="amin")
    full = (tile_end[None, :] - 1 <= tile_start[:, None]) & (min_leave[None, :] >= tile_end[:, None])  # (Qb, Kb)
    full &= whole[:, None] & whole[None, :]
    if window is not None:
        full = torch.zeros_like(full)  # a window may cut any tile: the mask function decides everywhere
    partial = any_visible & ~full
    partial_num, partial_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(n, n)
    )


def tree_mask(row: PackedRow, window: int | None = None) -> torch.Tensor | BlockMask:
    """The attention mask of ``row`` on its device: a FlexAttention BlockMask on CUDA, a dense mask elsewhere.

    With ``window``, the mask of a sliding-window layer of that width (see :func:`dense_window_mask`).
    """
    if row.dfs_enter.is_cuda:
        return flex_tree_mask(row.dfs_enter, row.dfs_leave, row.position_ids, window)
    mask = dense_tree_mask(row.dfs_enter, row.dfs_leave)
    if window is not None:
        mask &= dense_window_mask(row.position_ids, window)
    return mask


_compiled_flex: Callable[..., torch.Tensor] | None = None


def _flex() -> Callable[..., torch.Tensor]:
    """FlexAttention, compiled once on first use (eager inside an outer compile, or on CPU)."""
    global _compiled_flex
    if torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def tree_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as :data:`TREE_ATTENTION` (transformers' calling convention).

    Args:
        module: The calling attention module (unused beyond the convention).
        query: (B, Hq, N, d).
        key: (B, Hkv, N, d).
        value: (B, Hkv, N, d).
        attention_mask: A :class:`BlockMask` (FlexAttention), a (B, 1, N, N) boolean mask (SDPA),
            or ``None`` for plain causal attention (the model used outside packed rows).
        scaling: Softmax scale (``None``: 1/sqrt(d)).
        **kwargs: Other arguments of the convention (dropout, ...), ignored: dropout is refused
            by :func:`enable_tree_attention`.

    Returns:
        The attention output (B, N, Hq, d) and ``None`` (no weights).
    """
    softcap = cast(float | None, kwargs.get("softcap"))
    window = cast(int | None, kwargs.get("sliding_window"))
    gqa = query.shape[1] != key.shape[1]
    if isinstance(attention_mask, BlockMask):
        flex: Callable[..., torch.Tensor] = flex_attention
        if query.is_cuda:
            flex = _flex()
        score_mod = None if softcap is None else _softcap_score_mod(softcap)
        out = flex(
            query, key, value, score_mod=score_mod, block_mask=attention_mask, scale=scaling, enable_gqa=gqa
        )
    else:
        if gqa:
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        if attention_mask is None and (softcap is not None or window is not None):
            # Outside packed rows (no mask): causal, and windowed on a sliding-window layer.
            positions = torch.arange(query.shape[2], device=query.device)
            attention_mask = dense_tree_mask(positions, torch.full_like(positions, query.shape[2]))
            if window is not None:
                attention_mask = attention_mask & dense_window_mask(positions, window)
        if softcap is None:
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=attention_mask is None
            )
        else:  # SDPA has no soft-capping: the scores are formed explicitly (CPU rows are small)
            assert attention_mask is not None  # built above
            out = _softcapped_attention(query, key, value, attention_mask, scaling, softcap)
    return out.transpose(1, 2).contiguous(), None


def _softcap_score_mod(softcap: float) -> Callable[..., torch.Tensor]:
    """FlexAttention ``score_mod`` of attention logit soft-capping: ``softcap * tanh(score / softcap)``."""

    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return softcap * torch.tanh(score / softcap)

    return score_mod


def _softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    """Dense attention with soft-capped logits: (B, H, N, d) inputs (heads already repeated), boolean mask."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query @ key.transpose(-1, -2)) * scale  # (B, H, N, N)
    scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype) @ value


def check_softcap_device(device: torch.device) -> None:
    """Raise :class:`UnsupportedModelError` for attention logit soft-capping on an AMD or NVIDIA Blackwell GPU.

    The reference trainer refuses soft-capped models (Gemma 2) exactly there, where it loads
    flash-attention kernels that cannot soft-cap; this trainer keeps the same support matrix.
    """
    if device.type != "cuda":
        return
    if torch.version.hip:
        raise UnsupportedModelError(
            "models that soft-cap attention logits (attn_logit_softcapping, e.g. Gemma 2) are not supported on "
            "AMD (ROCm) GPUs: train them on a pre-Blackwell NVIDIA GPU or on CPU"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 10:
        raise UnsupportedModelError(
            "models that soft-cap attention logits (attn_logit_softcapping, e.g. Gemma 2) are not supported on "
            f"NVIDIA Blackwell GPUs (compute capability {major}.{minor}): train them on an earlier NVIDIA GPU"
        )


_PER_SAMPLE_ADVICE = (
    "Train it without tree packing: AsyncGRPOConfig(packing='per_sample') forwards each sample on its own "
    "through the model's own layers (slower: a group's prompt is forwarded once per sample)"
)


def check_tree_attention_support(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` when ``model`` has layers tree packing would run wrongly.

    Supported: full-attention layers (tree attention) and Gated DeltaNet layers (Qwen3.5, Qwen3.6,
    Qwen3-Next: :mod:`trainer.training.gated_deltanet`) and sliding-window layers named in
    ``layer_types`` (Gemma 2: the window runs along each token's path in the trie). Attention logit
    soft-capping works except on AMD and NVIDIA Blackwell GPUs (:func:`check_softcap_device`).
    Refused: other recurrent or linear-attention layers (Mamba2, short convolutions), a sliding
    window without ``layer_types``, attention sinks and attention dropout. (Final-logit soft-capping
    is applied by the chunked LM head, :func:`trainer.training.logprobs.final_logit_softcap`.)
    """
    config = cast(PreTrainedModel, model).config.get_text_config()
    name = type(model).__name__
    layer_types = list(getattr(config, "layer_types", None) or [])
    other = sorted(set(layer_types) - {"full_attention", "linear_attention", "sliding_attention"})
    num_linear = layer_types.count("linear_attention")
    if num_linear and len(gated_deltanet_modules(model)) != num_linear:
        other.append("linear_attention (not a Gated DeltaNet module)")
    if other:
        raise UnsupportedModelError(
            f"{name} has layers of type {other}; tree packing runs full-attention and Gated DeltaNet layers "
            "(Qwen3, Qwen3.5/3.6, Qwen3-Next, Gemma 2, Llama-style models) and sliding-window layers but not "
            f"these. {_PER_SAMPLE_ADVICE}"
        )
    if not layer_types and getattr(config, "sliding_window", None):
        raise UnsupportedModelError(f"{name} uses sliding-window attention without layer_types, which tree attention "
                                    f"does not implement. {_PER_SAMPLE_ADVICE}")
    if getattr(config, "attn_logit_softcapping", None) and (param := next(model.parameters(), None)) is not None:
        check_softcap_device(param.device)  # again on each row's device, in packed_hidden_states
    if getattr(config, "attention_dropout", 0.0):
        raise UnsupportedModelError(f"{name} has attention_dropout > 0, which tree attention does not implement. "
                                    f"{_PER_SAMPLE_ADVICE}")
    for module_name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise UnsupportedModelError(
                f"{name} has attention sinks ({module_name}.sinks), which tree attention does not implement. "
                f"{_PER_SAMPLE_ADVICE}"
            )


def enable_tree_attention(model: nn.Module) -> nn.Module:
    """Register the tree-attention backend and switch ``model`` to it (in place; returns ``model``).

    transformers builds no mask of its own for the backend (it has no mask function registered):
    the row's mask is passed as the 4D ``attention_mask``, which transformers forwards untouched.
    With no mask the backend is plain causal attention, so the model still works on ordinary input.

    Raises:
        UnsupportedModelError: See :func:`check_tree_attention_support`.
    """
    check_tree_attention_support(model)
    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    cast(PreTrainedModel, model).set_attn_implementation(TREE_ATTENTION)
    enable_tree_gated_deltanet(model)
    return model


def unwrap_model(model: nn.Module) -> PreTrainedModel:
    """The model inside DDP/FSDP-style wrappers (those that keep it as ``.module``).

    Typed as the transformers model it is, or a PEFT model that forwards that model's attributes.
    """
    while isinstance(inner := getattr(model, "module", None), nn.Module):
        model = inner
    return cast(PreTrainedModel, model)


def decoder_hidden_states(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                          attention_mask: object) -> torch.Tensor:
    """Call ``model`` on a batch and return its decoder's final hidden states (B, L, D).

    The call goes through ``model(...)`` itself, so wrappers (DDP, PEFT) see a normal forward
    (DDP only synchronises gradients of forwards it ran); ``logits_to_keep`` is empty, so the LM
    head computes nothing there, and a hook on the decoder collects its output.
    """
    captured: list[torch.Tensor] = []
    decoder = unwrap_model(model).get_decoder()
    hook = decoder.register_forward_hook(lambda mod, args, out: captured.append(out.last_hidden_state))
    try:
        model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False,
              logits_to_keep=input_ids.new_empty(0))
    finally:
        hook.remove()
    return captured[0]


def packed_hidden_states(model: nn.Module, row: PackedRow) -> torch.Tensor:
    """Run ``model`` on a packed row and return the decoder's final hidden states (N, D)
    (:func:`decoder_hidden_states`).

    ``row`` must be on the model's device and the model switched by :func:`enable_tree_attention`.
    """
    core = unwrap_model(model)
    if core.config._attn_implementation != TREE_ATTENTION:
        raise ValueError(f"{type(core).__name__} does not use tree attention: call enable_tree_attention(model) first")
    mask: object = tree_mask(row)
    config = core.config.get_text_config()
    if getattr(config, "attn_logit_softcapping", None):  # here, not per layer: no device query in a compiled graph
        check_softcap_device(row.input_ids.device)
    layer_types = getattr(config, "layer_types", None) or []
    # Models with several layer types take one mask per type (transformers reads a dict mask so).
    masks: dict[str, object] = {"full_attention": mask}
    window = getattr(config, "linear_conv_kernel_dim", None)
    if window and "linear_attention" in layer_types:  # the Gated DeltaNet layers read the row's trie layout
        masks["linear_attention"] = TreeLayout.from_row(row, window)
    if "sliding_attention" in layer_types:
        masks["sliding_attention"] = tree_mask(row, config.sliding_window)
    if len(masks) > 1:
        mask = masks
    return decoder_hidden_states(model, row.input_ids[None], row.position_ids[None], mask)[0]
