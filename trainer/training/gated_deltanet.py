"""Gated DeltaNet layers on a tree-packed row (Qwen3.5, Qwen3.6, Qwen3-Next hybrids).

A Gated DeltaNet layer mixes tokens in two recurrent steps, and both must follow each token's own
path through the row's prefix trie, never the depth-first order (which puts the last token of one
branch right before the first token of its sibling):

* The short causal convolution (window W, 4 in these models) reads each token's W - 1 predecessors
  *along its trie path*: :attr:`TreeLayout.ancestors`.
* The chunked gated delta rule runs each *segment* (a run of trie nodes without branching, one
  contiguous range of the row) from the final recurrent state of its parent segment, i.e. the state
  at the branch point. Segments of one depth in the segment tree are independent given their parents'
  states, so each depth is one variable-length call with per-segment initial states
  (:attr:`TreeLayout.levels`).

:func:`enable_tree_gated_deltanet` gives every Gated DeltaNet module of a model a forward that does this
when its ``attention_mask`` is a :class:`TreeLayout` (the packed forward passes one; see
``trainer.training.tree_attention.packed_hidden_states``) and runs the stock forward otherwise. The
delta rule runs on flash-linear-attention (``fla-core``) on CUDA where its kernels are valid
(``trainer.training.delta_rule``), else on transformers' torch reference, on every segment of a depth
at once.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.training.delta_rule import DeltaRule, delta_rule_for
from trainer.training.packing import PackedRow

__all__ = [
    "SegmentLevel",
    "TreeLayout",
    "enable_tree_gated_deltanet",
    "gated_deltanet_modules",
    "tree_causal_conv",
    "tree_gated_delta_rule",
]


@dataclass(frozen=True)
class SegmentLevel:
    """The segments of one depth of the segment tree, as one variable-length batch.

    ``tokens`` lists the row indices of the level's tokens, segment after segment (each segment a
    contiguous range of the row); ``cu_seqlens`` are the segments' boundaries in it (flash-attention
    style); ``parents`` is, per segment, the index of its parent segment in the previous level (-1 at
    level 0: a root segment starts from the zero state).
    """

    tokens: torch.Tensor  # (T_l,) int64
    cu_seqlens: torch.Tensor  # (S_l + 1,) int64
    parents: torch.Tensor  # (S_l,) int64
    max_len: int


@dataclass(frozen=True)
class TreeLayout:
    """What the recurrent layers need of a packed row's trie, computed once per row.

    ``ancestors[i, j]`` is the row index of token ``i``'s j-th predecessor along its trie path (j = 0:
    the token itself), ``-1`` above the root. ``levels`` are the segment-tree depths in order; ``order``
    maps each row token to its position in the concatenation of the levels' ``tokens``.
    """

    ancestors: torch.Tensor  # (N, W) int64
    levels: tuple[SegmentLevel, ...]
    order: torch.Tensor  # (N,) int64

    @classmethod
    def from_row(cls, row: PackedRow, window: int) -> TreeLayout:
        """The layout of ``row`` (on any device; the result is on the row's device).

        Args:
            row: A packed row (depth-first layout, ``position_ids`` = depth in the trie).
            window: The convolution window W (``linear_conv_kernel_dim``).
        """
        device = row.input_ids.device
        depth = row.position_ids.cpu()
        leave = row.dfs_leave.cpu()
        segment = row.segment_ids.cpu()
        n = depth.numel()
        starts = torch.ones(n, dtype=torch.bool)
        starts[1:] = segment[1:] != segment[:-1]
        seg_start = starts.nonzero().squeeze(1)  # (S,)
        seg_end = torch.cat([seg_start[1:], torch.tensor([n])]) - 1  # (S,) last token of each segment
        # A segment's parent segment ends at its branch point: the ancestor one level up, found among
        # the segment ends as the one whose subtree holds the start and whose depth is one less.
        s_depth = depth[seg_start]
        holds = (seg_end[None, :] < seg_start[:, None]) & (leave[seg_end][None, :] > seg_start[:, None])
        holds &= depth[seg_end][None, :] == (s_depth - 1)[:, None]  # (S, S)
        has_parent = holds.any(1)
        if not torch.equal(has_parent, s_depth > 0):
            raise ValueError("row is not a depth-first trie layout (a segment has no parent at the branch point)")
        parent_seg = torch.where(has_parent, holds.int().argmax(1), -1)  # (S,)
        parent = torch.arange(n) - 1  # (N,) trie parent's row index; -1 at the root
        parent[seg_start] = torch.where(has_parent, seg_end[parent_seg.clamp(min=0)], -1)

        ancestors = [torch.arange(n)]
        for _ in range(window - 1):
            prev = ancestors[-1]
            ancestors.append(torch.where(prev >= 0, parent[prev.clamp(min=0)], -1))

        level_of = [0] * len(seg_start)
        for s, p in enumerate(parent_seg.tolist()):  # parents precede children in pre-order
            level_of[s] = level_of[p] + 1 if p >= 0 else 0
        levels, order = [], torch.empty(n, dtype=torch.long)
        index_in_level: dict[int, int] = {}
        offset = 0
        for level in range(max(level_of) + 1):
            segs = [s for s, lv in enumerate(level_of) if lv == level]
            for i, s in enumerate(segs):
                index_in_level[s] = i
            lengths = (seg_end[segs] - seg_start[segs] + 1).tolist()
            tokens = torch.cat([torch.arange(int(seg_start[s]), int(seg_end[s]) + 1) for s in segs])
            order[tokens] = torch.arange(offset, offset + tokens.numel())
            offset += tokens.numel()
            parents = [index_in_level[int(parent_seg[s])] if parent_seg[s] >= 0 else -1 for s in segs]
            levels.append(SegmentLevel(
                tokens=tokens.to(device),
                cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device),
                parents=torch.tensor(parents, dtype=torch.long, device=device),
                max_len=max(lengths),
            ))
        return cls(ancestors=torch.stack(ancestors, 1).to(device), levels=tuple(levels), order=order.to(device))


def tree_causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ancestors: torch.Tensor, activation: str
) -> torch.Tensor:
    """The depthwise causal convolution of a row, each token reading its own trie path.

    Args:
        x: (N, C) inputs in row order.
        weight: (C, W) depthwise kernel (``conv1d.weight.squeeze(1)``; tap W - 1 is the token itself).
        bias: (C,) or ``None``.
        ancestors: (N, W) from :attr:`TreeLayout.ancestors`.
        activation: ``"silu"`` (these models) or ``"identity"``.

    Returns:
        (N, C) outputs, equal to ``causal_conv1d`` over each token's own path.
    """
    width = weight.shape[-1]
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row N is the zero input above the root
    idx = torch.where(ancestors >= 0, ancestors, x.shape[0])  # (N, W)
    out = padded[idx[:, 0]] * weight[:, width - 1].to(x.dtype)  # (N, C): the token itself
    for j in range(1, width):
        out = out + padded[idx[:, j]] * weight[:, width - 1 - j].to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return F.silu(out) if activation == "silu" else out


# Eager even inside a compiled decoder layer: the torch rule traced by dynamo gave wrong gradients
# (torch 2.13), and fla's kernels are opaque to it anyway.
@torch.compiler.disable  # type: ignore[untyped-decorator]  # unannotated in torch
def tree_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, layout: TreeLayout,
    rule: DeltaRule | None = None,
) -> torch.Tensor:
    """The gated delta rule over a row's trie: each segment starts from its parent's final state.

    Args:
        q, k: (N, H, K) in row order (q and k not yet L2-normalised: the rule does it).
        v: (N, H, V).
        g: (N, H) log-decay (<= 0).
        beta: (N, H) write strength.
        layout: The row's :class:`TreeLayout`.
        rule: A varlen rule ``(q, k, v, g, beta, initial_state, cu_seqlens, max_len) -> (out, final)``;
            default ``delta_rule_for`` (the one ``select_delta_rule`` chose, valid here).

    Returns:
        (N, H, V) outputs in row order.
    """
    if rule is None:
        rule = delta_rule_for(q, v)
    heads, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    outs: list[torch.Tensor] = []
    states: torch.Tensor | None = None
    for level in layout.levels:
        num = level.parents.numel()
        if states is None:
            init = q.new_zeros(num, heads, dk, dv, dtype=torch.float32)
        else:
            init = states[level.parents]
        t = level.tokens
        out, states = rule(q[t], k[t], v[t], g[t], beta[t], init, level.cu_seqlens, level.max_len)
        outs.append(out)
    return torch.cat(outs)[layout.order]


def gated_deltanet_modules(model: nn.Module) -> list[nn.Module]:
    """The Gated DeltaNet modules of ``model`` that :func:`enable_tree_gated_deltanet` can run on a tree."""
    return [m for m in model.modules() if _projections(m) is not None]


def _projections(module: Any) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None:
    """The input projection of a known Gated DeltaNet module: hidden (N, D) -> (qkv (N, C), z, b, a)."""
    if not all(hasattr(module, name) for name in ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "head_v_dim")):
        return None
    if hasattr(module, "in_proj_qkv"):  # Qwen3.5 / Qwen3.6: one projection per output

        def qwen3_5(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
            z = module.in_proj_z(h).reshape(h.shape[0], -1, module.head_v_dim)
            return module.in_proj_qkv(h), z, module.in_proj_b(h), module.in_proj_a(h)

        return qwen3_5
    if hasattr(module, "in_proj_qkvz") and hasattr(module, "fix_query_key_value_ordering"):  # Qwen3-Next

        def qwen3_next(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
            qkvz, ba = module.in_proj_qkvz(h)[None], module.in_proj_ba(h)[None]
            q, k, v, z, b, a = module.fix_query_key_value_ordering(qkvz, ba)
            qkv = torch.cat([x.reshape(h.shape[0], -1) for x in (q, k, v)], dim=-1)
            return qkv, z[0], b[0], a[0]

        return qwen3_next
    return None


def _tree_forward(module: Any, hidden_states: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """One Gated DeltaNet layer on a packed row (batch of one): the stock math along trie paths."""
    h = hidden_states[0]  # (N, D)
    n = h.shape[0]
    mixed, z, b, a = _projections(module)(h)  # type: ignore[misc]
    mixed = tree_causal_conv(mixed, module.conv1d.weight.squeeze(1), module.conv1d.bias, layout.ancestors,
                             module.activation)
    q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q, k = q.reshape(n, -1, module.head_k_dim), k.reshape(n, -1, module.head_k_dim)
    v = v.reshape(n, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)  # (N, Hv), float32 like the stock layer
    repeat = module.num_v_heads // module.num_k_heads
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    core = tree_gated_delta_rule(q, k, v, g, beta, layout).to(h.dtype)  # (N, Hv, V)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    out: torch.Tensor = module.out_proj(core.reshape(1, n, -1))
    return out


def _dispatching_forward(self: nn.Module, hidden_states: torch.Tensor, cache_params: object = None,
                         attention_mask: object = None, **kwargs: object) -> torch.Tensor:
    """The forward installed on a Gated DeltaNet module: the tree path for a :class:`TreeLayout`, else stock."""
    if isinstance(attention_mask, TreeLayout):
        return _tree_forward(self, hidden_states, attention_mask)
    stock: torch.Tensor = type(self).forward(self, hidden_states, cache_params=cache_params,
                                             attention_mask=attention_mask, **kwargs)
    return stock


def enable_tree_gated_deltanet(model: nn.Module) -> int:
    """Give every Gated DeltaNet module of ``model`` the tree-aware forward (in place); return how many.

    The module keeps its stock forward for any ``attention_mask`` that is not a :class:`TreeLayout`
    (generation, plain batches). Idempotent.
    """
    modules = gated_deltanet_modules(model)
    for module in modules:
        # A bound method (not a closure) so that deepcopy/pickle of the model rebinds it to the copy.
        module.forward = types.MethodType(_dispatching_forward, module)
    return len(modules)
