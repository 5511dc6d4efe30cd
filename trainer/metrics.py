"""Metrics over a logging window, with their aggregation rules (as in TRL's AsyncGRPOTrainer).

Within a window (everything recorded since the last log):

* a name whose last part contains the word ``count`` is summed (``sample/dropped_stale_count``);
* a last part containing the word ``max`` / ``min`` keeps the extreme (``completions/max_length``);
* a rate (recorded with :meth:`MetricWindow.add_rate`, e.g. ``rollout/generated_tokens_per_s``)
  is sum of numerators / sum of denominators;
* anything else is the mean of the recorded values (``_per_step`` values are recorded once per
  step, so they average over the window's steps).

Records cross process boundaries as plain tuples (:data:`Record`), so the rollout worker can
batch them onto a queue.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

# ("value", name, x, 0.0) or ("rate", name, numerator, denominator)
Record = tuple[str, str, float, float]


def reduction(name: str) -> str:
    """The window rule for ``name``: ``sum``, ``max``, ``min`` or ``mean``.

    Matches whole words of the last part (``_``-separated), not substrings: the ``min`` in
    ``completions/mean_terminated_length`` does not make it a minimum.
    """
    words = set(name.rsplit("/", 1)[-1].split("_"))
    if "count" in words:
        return "sum"
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


@dataclass
class _Acc:
    total: float = 0.0
    n: int = 0
    extreme: float | None = None
    den: float = 0.0
    rate: bool = False


@dataclass
class MetricWindow:
    """Accumulates records until :meth:`flush` reduces them to one value per name."""

    _acc: dict[str, _Acc] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        """Record one observation of ``name``."""
        acc = self._acc.setdefault(name, _Acc())
        value = float(value)
        acc.total += value
        acc.n += 1
        rule = reduction(name)
        if rule == "max":
            acc.extreme = value if acc.extreme is None else max(acc.extreme, value)
        elif rule == "min":
            acc.extreme = value if acc.extreme is None else min(acc.extreme, value)

    def add_rate(self, name: str, numerator: float, denominator: float) -> None:
        """Record a rate's parts (tokens and seconds, failures and calls...)."""
        acc = self._acc.setdefault(name, _Acc(rate=True))
        acc.total += float(numerator)
        acc.den += float(denominator)
        acc.n += 1

    def add_records(self, records: Iterable[Record]) -> None:
        """Merge records produced elsewhere (e.g. by the rollout worker)."""
        for kind, name, a, b in records:
            if kind == "rate":
                self.add_rate(name, a, b)
            else:
                self.add(name, a)

    def flush(self) -> dict[str, float]:
        """The window's values (NaN for a rate with a zero denominator); starts a new window."""
        out: dict[str, float] = {}
        for name, acc in self._acc.items():
            if acc.rate:
                out[name] = acc.total / acc.den if acc.den else math.nan
                continue
            rule = reduction(name)
            if rule == "sum":
                out[name] = acc.total
            elif rule in ("max", "min"):
                out[name] = float(acc.extreme)  # type: ignore[arg-type]
            else:
                out[name] = acc.total / acc.n
        self._acc = {}
        return out


class RecordBuffer:
    """Collects records in the worker between two sends."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def add(self, name: str, value: float) -> None:
        """Record one value."""
        self.records.append(("value", name, float(value), 0.0))

    def add_rate(self, name: str, numerator: float, denominator: float) -> None:
        """Record one rate observation."""
        self.records.append(("rate", name, float(numerator), float(denominator)))

    def take(self) -> list[Record]:
        """Everything recorded since the last call."""
        out, self.records = self.records, []
        return out
