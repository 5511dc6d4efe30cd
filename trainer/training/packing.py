"""Tree packing: samples laid out as a prefix trie in one row, and the planner that fills the rows.

A row is a prefix trie of its samples, not a concatenation: a token that several samples share is
forwarded once, and attention still shows each sample exactly its own history (the DFS intervals
below; see ``docs/packing.md``). Nodes are keyed on *(token, next token)*: a position
predicts one token, so two samples share a position only when they also agree on what follows it.
With two rollouts ``p1 p2 p3 a1 a2`` and ``p1 p2 p3 b1 b2`` that gives the 8-token row of ``docs/packing.md``
``p1 p2 | p3 a1 a2 | p3 b1 b2`` with positions ``0 1 | 2 3 4 | 2 3 4``.

The layout is depth-first (pre-order), with ``position_ids`` = depth. Node ``k`` is an ancestor of
(or is) node ``q`` iff ``dfs_enter[k] <= dfs_enter[q] < dfs_leave[k]``: that one interval test is the
whole attention mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.exceptions import OversizeSampleError
from trainer.records import TrainingSample

__all__ = ["OversizeSampleError", "PackedRow", "RowPlanner", "batch_metrics", "build_row"]


@dataclass
class PackedRow:
    """One process's row of a micro-batch: the trie's tokens and, per trained token, its loss inputs.

    Per forwarded token (N of them, in depth-first order): ``input_ids``, ``position_ids`` (= depth
    in the trie), ``dfs_enter``/``dfs_leave`` (key ``k`` is visible to query ``q`` iff
    ``dfs_enter[k] <= dfs_enter[q] < dfs_leave[k]``) and ``segment_ids`` (a segment is a run of
    nodes without branching, the ``S0 | S1 | S2`` of the example in ``docs/packing.md``).

    Per trained token (T of them, sample by sample): ``pred_index`` (row index of the position that
    predicts it), ``target_ids``, ``advantages``, ``sampler_logprobs`` (log q of the target),
    the sampler's top-K candidates ``sampler_topk_ids``/``sampler_topk_logprobs`` with
    ``sampler_topk_valid`` marking real entries (K = the row's largest top-k; shorter lists are
    padded), the top-k/top-p candidate sets ``candidate_ids``/``candidate_valid`` (``None`` when no
    token of the row has one; a token whose row of ``candidate_valid`` is all False uses the whole
    vocabulary) and ``token_sample`` (index of the token's sample in the row).
    """

    input_ids: torch.Tensor  # (N,) int64
    position_ids: torch.Tensor  # (N,) int64
    dfs_enter: torch.Tensor  # (N,) int64
    dfs_leave: torch.Tensor  # (N,) int64
    segment_ids: torch.Tensor  # (N,) int64
    pred_index: torch.Tensor  # (T,) int64
    target_ids: torch.Tensor  # (T,) int64
    advantages: torch.Tensor  # (T,) float32
    sampler_logprobs: torch.Tensor  # (T,) float32
    sampler_topk_ids: torch.Tensor  # (T, K) int64
    sampler_topk_logprobs: torch.Tensor  # (T, K) float32
    sampler_topk_valid: torch.Tensor  # (T, K) bool
    candidate_ids: torch.Tensor | None  # (T, M) int64
    candidate_valid: torch.Tensor | None  # (T, M) bool
    token_sample: torch.Tensor  # (T,) int64
    sample_group_ids: tuple[int, ...]  # group of each sample
    num_unpacked_tokens: int  # sum of the samples' lengths (before sharing)
    num_unique_tokens: int  # trie nodes: what the row forwards (a dummy pad of an empty row excluded)
    attention_cost: int  # query-key pairs the tree mask allows: sum over nodes of (depth + 1)

    @property
    def num_samples(self) -> int:
        """Samples packed in the row."""
        return len(self.sample_group_ids)

    @property
    def num_trained(self) -> int:
        """Trained tokens of the row (T)."""
        return int(self.target_ids.numel())

    def select_trained(self, tokens: slice) -> PackedRow:
        """The row with only the trained tokens ``tokens`` (a slice of 0..T): a chunk of its loss inputs.

        The per-trained-token tensors become views of that slice; the forwarded tokens are kept,
        so ``pred_index`` still points into the whole row.
        """
        per_trained: dict[str, Any] = {  # checked per field by dataclasses.replace, not by mypy
            name: value[tokens]
            for name in _TRAINED_FIELDS
            if isinstance(value := getattr(self, name), torch.Tensor)
        }
        return dataclasses.replace(self, **per_trained)

    def to(self, device: torch.device | str) -> PackedRow:
        """Return a copy with every tensor on ``device``."""
        moved: dict[str, Any] = {
            f.name: value.to(device, non_blocking=True)
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def padded_to_multiple(self, multiple: int, pad_token_id: int = 0) -> PackedRow:
        """The row with pad tokens appended up to a multiple of ``multiple`` forwarded tokens, so that a
        step compiled for static shapes sees few lengths (``AsyncGRPOConfig.compile_row_bucket``).

        The pads are one chain of their own at the trie's root: each sees only the pads before it,
        and no real token sees a pad, so every real token's log-probs and gradients are unchanged.
        Nothing new is trained, and the counts (``num_unique_tokens``, ``attention_cost``) stay the
        real ones (metrics and FLOPs count what the row holds, not its padding).
        """
        n = self.input_ids.numel()
        p = -n % multiple
        if p == 0:
            return self
        device = self.input_ids.device
        chain = torch.arange(p, device=device)  # (P,)
        return dataclasses.replace(
            self,
            input_ids=torch.cat([self.input_ids, torch.full((p,), pad_token_id, device=device)]),
            position_ids=torch.cat([self.position_ids, chain]),
            dfs_enter=torch.cat([self.dfs_enter, n + chain]),  # pad i is an ancestor of pads i+1..P-1
            dfs_leave=torch.cat([self.dfs_leave, torch.full((p,), n + p, device=device)]),
            segment_ids=torch.cat([self.segment_ids, torch.full((p,), int(self.segment_ids.max()) + 1,
                                                                device=device)]),
        )

    @classmethod
    def empty(cls, pad_token_id: int = 0) -> PackedRow:
        """A row for a process that got no sample: one pad token, nothing trained.

        The forward still runs (so every parameter receives a zero gradient and collective
        operations stay in step) and the loss is exactly zero.
        """
        one = torch.zeros(1, dtype=torch.long)
        none = torch.zeros(0, dtype=torch.long)
        return cls(
            input_ids=torch.full((1,), pad_token_id, dtype=torch.long),
            position_ids=one.clone(),
            dfs_enter=one.clone(),
            dfs_leave=torch.ones(1, dtype=torch.long),
            segment_ids=one.clone(),
            pred_index=none,
            target_ids=none.clone(),
            advantages=torch.zeros(0),
            sampler_logprobs=torch.zeros(0),
            sampler_topk_ids=torch.zeros(0, 0, dtype=torch.long),
            sampler_topk_logprobs=torch.zeros(0, 0),
            sampler_topk_valid=torch.zeros(0, 0, dtype=torch.bool),
            candidate_ids=None,
            candidate_valid=None,
            token_sample=none.clone(),
            sample_group_ids=(),
            num_unpacked_tokens=0,
            num_unique_tokens=0,
            attention_cost=0,
        )


_TRAINED_FIELDS = (
    "pred_index", "target_ids", "advantages", "sampler_logprobs", "sampler_topk_ids", "sampler_topk_logprobs",
    "sampler_topk_valid", "candidate_ids", "candidate_valid", "token_sample",
)
"""The :class:`PackedRow` fields with one entry per trained token."""

_ROOT = 0


class _Trie:
    """Prefix trie over token sequences; node 0 is a virtual root, real nodes are 1..n."""

    def __init__(self, share_prefixes: bool) -> None:
        self.share_prefixes = share_prefixes
        self.tokens: list[int] = [-1]
        self.depths: list[int] = [-1]
        self.parents: list[int] = [-1]
        self.children: list[list[int]] = [[]]
        self._lookup: list[dict[tuple[int, int], int]] = [{}]
        self.attention_cost = 0

    @property
    def num_nodes(self) -> int:
        return len(self.tokens) - 1

    @staticmethod
    def _keys(ids: Sequence[int]) -> list[tuple[int, int]]:
        # A node is shared only when the samples agree on its token *and* the next one (or both end).
        nxt = list(ids[1:]) + [-1]
        return list(zip(ids, nxt, strict=True))

    def shared_length(self, ids: Sequence[int]) -> int:
        """Number of leading tokens of ``ids`` already in the trie."""
        if not self.share_prefixes:
            return 0
        node, depth = _ROOT, 0
        for key in self._keys(ids):
            node = self._lookup[node].get(key, -1)
            if node < 0:
                break
            depth += 1
        return depth

    def insert(self, ids: Sequence[int]) -> list[int]:
        """Insert a sequence; return the node of each of its tokens."""
        path: list[int] = []
        node = _ROOT
        for depth, key in enumerate(self._keys(ids)):
            child = self._lookup[node].get(key, -1) if self.share_prefixes else -1
            if child < 0:
                child = len(self.tokens)
                self.tokens.append(key[0])
                self.depths.append(depth)
                self.parents.append(node)
                self.children.append([])
                self._lookup.append({})
                self.children[node].append(child)
                self._lookup[node][key] = child
                self.attention_cost += depth + 1
            path.append(child)
            node = child
        return path

    def layout(self) -> tuple[list[int], list[int], list[int]]:
        """Depth-first pre-order: (row index of each node, dfs_leave of each node, segment of each node)."""
        n = len(self.tokens)
        order: list[int] = []
        stack = list(reversed(self.children[_ROOT]))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(self.children[node]))
        index = [0] * n
        for i, node in enumerate(order):
            index[node] = i
        size = [1] * n
        for node in reversed(order):
            parent = self.parents[node]
            if parent != _ROOT:
                size[parent] += size[node]
        leave = [index[node] + size[node] for node in range(n)]
        segment = [0] * n
        current = -1
        for node in order:
            parent = self.parents[node]
            if parent == _ROOT or len(self.children[parent]) > 1:
                current += 1
            segment[node] = current
        return index, leave, segment


@dataclass
class _TrainedTokens:
    """Every trained token of a row, flattened sample by sample (the per-token columns of a row)."""

    pred_index: list[int] = dataclasses.field(default_factory=list)
    target_ids: list[int] = dataclasses.field(default_factory=list)
    advantages: list[float] = dataclasses.field(default_factory=list)
    sampler_logprobs: list[float] = dataclasses.field(default_factory=list)
    token_sample: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    candidates: list[list[int]] = dataclasses.field(default_factory=list)

    @classmethod
    def collect(
        cls, samples: Sequence[TrainingSample], paths: Sequence[list[int]], index: list[int]
    ) -> _TrainedTokens:
        out = cls()
        for s, (sample, path) in enumerate(zip(samples, paths, strict=True)):
            seq = sample.sequence
            for i, trained in enumerate(seq.loss_mask):
                if not trained:
                    continue
                out.pred_index.append(index[path[i - 1]])  # token i is predicted at position i - 1
                out.target_ids.append(seq.input_ids[i])
                out.advantages.append(sample.advantage if sample.token_advantages is None
                                      else sample.token_advantages[i])
                out.sampler_logprobs.append(seq.sampler_logprobs[i])
                out.token_sample.append(s)
                out.top_logprobs.append((seq.sampler_top_logprobs[i] if seq.sampler_top_logprobs else None) or {})
                out.candidates.append((seq.sampling_masks[i] if seq.sampling_masks else None) or [])
        return out


def _pad_ragged(
    rows: Sequence[Sequence[int]], values: Sequence[Sequence[float]] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad ragged lists to (T, width): ids (int64), values (float32) and a validity mask."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    vals = torch.zeros(len(rows), width)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for t, r in enumerate(rows):
        if r:
            ids[t, : len(r)] = torch.tensor(r, dtype=torch.long)
            valid[t, : len(r)] = True
            if values is not None:
                vals[t, : len(r)] = torch.tensor(values[t], dtype=torch.float32)
    return ids, vals, valid


def _pack(trie: _Trie, samples: Sequence[TrainingSample], paths: Sequence[list[int]]) -> PackedRow:
    """Lay out a filled trie as a :class:`PackedRow`."""
    if not samples:
        return PackedRow.empty()
    index, leave, segment = trie.layout()
    n = trie.num_nodes
    by_row = sorted(range(1, n + 1), key=index.__getitem__)
    tt = _TrainedTokens.collect(samples, paths, index)
    topk_ids, topk_logq, topk_valid = _pad_ragged(
        [list(d) for d in tt.top_logprobs], [list(d.values()) for d in tt.top_logprobs]
    )
    candidate_ids = candidate_valid = None
    if any(tt.candidates):
        candidate_ids, _, candidate_valid = _pad_ragged(tt.candidates)
    return PackedRow(
        input_ids=torch.tensor([trie.tokens[k] for k in by_row], dtype=torch.long),
        position_ids=torch.tensor([trie.depths[k] for k in by_row], dtype=torch.long),
        dfs_enter=torch.arange(n, dtype=torch.long),
        dfs_leave=torch.tensor([leave[k] for k in by_row], dtype=torch.long),
        segment_ids=torch.tensor([segment[k] for k in by_row], dtype=torch.long),
        pred_index=torch.tensor(tt.pred_index, dtype=torch.long),
        target_ids=torch.tensor(tt.target_ids, dtype=torch.long),
        advantages=torch.tensor(tt.advantages, dtype=torch.float32),
        sampler_logprobs=torch.tensor(tt.sampler_logprobs, dtype=torch.float32),
        sampler_topk_ids=topk_ids,
        sampler_topk_logprobs=topk_logq,
        sampler_topk_valid=topk_valid,
        candidate_ids=candidate_ids,
        candidate_valid=candidate_valid,
        token_sample=torch.tensor(tt.token_sample, dtype=torch.long),
        sample_group_ids=tuple(s.group_id for s in samples),
        num_unpacked_tokens=sum(s.num_tokens for s in samples),
        num_unique_tokens=n,
        attention_cost=trie.attention_cost,
    )


def build_row(samples: Sequence[TrainingSample], share_prefixes: bool = True) -> PackedRow:
    """Pack ``samples`` into one row.

    Args:
        samples: The row's samples, in order (the layout visits them depth-first in this order).
        share_prefixes: Share common prefixes in a trie (tree packing). ``False`` gives plain
            padding-free packing: each sample is its own segment.

    Returns:
        The packed row (:meth:`PackedRow.empty` when ``samples`` is empty).
    """
    trie = _Trie(share_prefixes)
    paths = [trie.insert(s.sequence.input_ids) for s in samples]
    return _pack(trie, samples, paths)


class _PlannedRow:
    """A row being filled by the planner: its samples and their trie."""

    def __init__(self, share_prefixes: bool) -> None:
        self.share_prefixes = share_prefixes
        self.samples: list[TrainingSample] = []
        self.paths: list[list[int]] = []
        self.groups: set[int] = set()
        self.trie = _Trie(share_prefixes)

    @property
    def tokens(self) -> int:
        return self.trie.num_nodes

    @property
    def cost(self) -> int:
        return self.trie.attention_cost

    def cost_if_added(self, sample: TrainingSample) -> tuple[int, int]:
        """(unique tokens, attention cost) of the row with ``sample`` added."""
        ids = sample.sequence.input_ids
        length, shared = len(ids), self.trie.shared_length(ids)
        extra_cost = (length * (length + 1) - shared * (shared + 1)) // 2
        return self.tokens + length - shared, self.cost + extra_cost

    def add(self, sample: TrainingSample) -> None:
        self.samples.append(sample)
        self.groups.add(sample.group_id)
        self.paths.append(self.trie.insert(sample.sequence.input_ids))

    def take_last(self) -> list[TrainingSample]:
        """Remove and return the last group added (or only its last sample when it is the only group)."""
        last_group = self.samples[-1].group_id
        moved = [s for s in self.samples if s.group_id == last_group]
        if len(moved) == len(self.samples):
            moved = moved[-1:]
        kept = [s for s in self.samples if not any(s is m for m in moved)]
        self.samples, self.paths, self.groups, self.trie = [], [], set(), _Trie(self.share_prefixes)
        for s in kept:
            self.add(s)
        return moved

    def pack(self) -> PackedRow:
        return _pack(self.trie, self.samples, self.paths)


class RowPlanner:
    """Fill one row per process for a micro-batch, under a token budget (``docs/packing.md``).

    Placement of each sample, in order of preference: the row that already holds its group (its
    prompt is there already); a row that is still empty (every process should get work); for a
    group no row holds yet, the row with the lowest attention cost after adding it; for a group
    whose row is full, another row only when that does not raise the most expensive row's cost.
    A row's unique tokens never exceed ``token_budget``. When no row can take the sample, the
    micro-batch is *closed*: :meth:`add` returns ``False`` (the sample was not placed; keep it for
    the next micro-batch) until :meth:`rows` hands the micro-batch out and opens a new one.

    Args:
        num_rows: Rows per micro-batch (the number of processes).
        token_budget: Cap on a row's unique tokens (default in the trainer: the server's
            ``max_model_len``).
        share_prefixes: Tree packing (``True``) or plain padding-free packing.
    """

    def __init__(self, num_rows: int, token_budget: int, share_prefixes: bool = True) -> None:
        if num_rows < 1 or token_budget < 1:
            raise ValueError(f"num_rows and token_budget must be >= 1, got {num_rows} and {token_budget}")
        self.num_rows = num_rows
        self.token_budget = token_budget
        self.share_prefixes = share_prefixes
        self._open()

    def _open(self) -> None:
        self._rows = [_PlannedRow(self.share_prefixes) for _ in range(self.num_rows)]
        self.closed = False

    @property
    def num_samples(self) -> int:
        """Samples placed in the current micro-batch."""
        return sum(len(r.samples) for r in self._rows)

    def add(self, sample: TrainingSample) -> bool:
        """Place ``sample`` in the current micro-batch.

        Returns:
            ``True`` when placed; ``False`` when the micro-batch is closed and the sample was not
            placed (the caller keeps it for the next micro-batch).

        Raises:
            OversizeSampleError: The sample alone exceeds ``token_budget`` and is never placed:
                drop it with a warning and count it (``batch/dropped_oversize_count``).
        """
        if sample.num_tokens > self.token_budget:
            raise OversizeSampleError(sample, self.token_budget)
        if self.closed:
            return False
        row = self._choose_row(sample)
        if row is None:
            self.closed = True
            return False
        row.add(sample)
        return True

    def _choose_row(self, sample: TrainingSample) -> _PlannedRow | None:
        after = {id(r): r.cost_if_added(sample) for r in self._rows}
        fits = [r for r in self._rows if after[id(r)][0] <= self.token_budget]
        homes = [r for r in fits if sample.group_id in r.groups]
        if homes:
            return min(homes, key=lambda r: after[id(r)][1])
        empty = [r for r in fits if not r.samples]
        if empty:
            return empty[0]
        if any(sample.group_id in r.groups for r in self._rows):
            # Spilling a group loses the shared prompt: only when it does not slow the micro-batch.
            max_cost = max(r.cost for r in self._rows)
            fits = [r for r in fits if after[id(r)][1] <= max_cost]
        return min(fits, key=lambda r: after[id(r)][1], default=None)

    def rows(self) -> list[PackedRow]:
        """Hand out the micro-batch (one row per process) and open the next one.

        Every row is non-empty when at least ``num_rows`` samples were placed: samples move from
        the most expensive multi-sample rows to empty ones. Rows left empty are
        :meth:`PackedRow.empty`.
        """
        while True:
            empty = [r for r in self._rows if not r.samples]
            donors = [r for r in self._rows if len(r.samples) > 1]
            if not empty or not donors:
                break
            for s in max(donors, key=lambda r: r.cost).take_last():
                empty[0].add(s)
        packed = [r.pack() for r in self._rows]
        self._open()
        return packed


def batch_metrics(rows: Sequence[PackedRow], token_budget: int) -> dict[str, float]:
    """The source's ``batch/*`` metrics of one micro-batch (its rows, one per process).

    ``batch/row_tokens_*`` count forwarded (unique) tokens; ``batch/pad_frac`` is the padding that
    equal-length transfer of the rows would add (it is never forwarded); ``batch/masked_token_frac``
    is the fraction of the samples' tokens that are not trained; the ``*_per_step`` values are this
    micro-batch's totals (sum them over the micro-batches of a step).
    """
    n = len(rows)
    tokens = [r.num_unique_tokens for r in rows]
    costs = [r.attention_cost for r in rows]
    unpacked = sum(r.num_unpacked_tokens for r in rows)
    trained = sum(r.num_trained for r in rows)
    mean_cost = sum(costs) / n
    return {
        "batch/samples_per_row": sum(r.num_samples for r in rows) / n,
        "batch/row_tokens_mean": sum(tokens) / n,
        "batch/row_tokens_max": float(max(tokens)),
        "batch/row_fill_frac": sum(tokens) / (n * token_budget),
        "batch/row_imbalance": max(costs) / mean_cost if mean_cost else 1.0,
        "batch/packing_ratio": unpacked / sum(tokens) if sum(tokens) else 1.0,
        "batch/pad_frac": 1.0 - sum(tokens) / (n * max(tokens)) if max(tokens) else 0.0,
        "batch/masked_token_frac": 1.0 - trained / unpacked if unpacked else 0.0,
        "batch/forwarded_tokens_per_step": float(sum(tokens)),
        "batch/trained_tokens_per_step": float(trained),
        "batch/samples_per_step": float(sum(r.num_samples for r in rows)),
    }
