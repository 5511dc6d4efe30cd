"""One pass over the weights feeding several servers' syncs (:func:`trainer.sync.fan_out.fan_out`), on real threads."""

from __future__ import annotations

import threading

import pytest
import torch

from trainer.sync.fan_out import ReadDone, fan_out
from trainer.sync.weight_sync import TensorSource

WEIGHTS = [(f"w{i}", torch.full((2,), float(i))) for i in range(10)]


class _Once:
    """A source that may be read once (as FSDP2's gathered stream), with the stream's ``meta``."""

    def __init__(self) -> None:
        self.passes = 0

    def meta(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, torch.empty(t.shape)) for n, t in WEIGHTS]

    def __iter__(self):  # noqa: ANN204 - a generator
        self.passes += 1
        assert self.passes == 1, "read twice"
        yield from WEIGHTS


def _reader(seen: list[list[str]]):  # noqa: ANN202 - a consumer factory
    def consume(branch: TensorSource, done: ReadDone) -> int:
        assert [n for n, _ in branch.meta()] == [n for n, _ in WEIGHTS]  # type: ignore[attr-defined]
        names = [n for n, _ in branch]
        done()
        seen.append(names)
        return len(names)
    return consume


def test_every_consumer_gets_every_tensor_from_one_pass_and_read_done_fires_once_after_all() -> None:
    source, seen, fired = _Once(), [], []
    results = fan_out(source, [_reader(seen) for _ in range(3)], read_done=lambda: fired.append(len(seen)))
    assert results == [10, 10, 10] and source.passes == 1
    assert seen == [[n for n, _ in WEIGHTS]] * 3
    assert len(fired) == 1


def test_a_consumer_that_fails_is_left_behind_and_the_others_finish() -> None:
    seen: list[list[str]] = []
    fired = threading.Event()

    def dies(branch: TensorSource, done: ReadDone) -> int:
        next(iter(branch))
        raise ConnectionRefusedError("the server is gone")

    results = fan_out(_Once(), [dies, _reader(seen)], read_done=fired.set, depth=1)
    assert isinstance(results[0], ConnectionRefusedError) and results[1] == 10
    assert fired.is_set()  # a failed consumer counts as done reading


def test_a_failing_source_reaches_every_consumer_and_the_caller() -> None:
    def broken():  # noqa: ANN202 - a generator
        yield WEIGHTS[0]
        raise RuntimeError("gather failed")

    seen: list[list[str]] = []

    def consume(branch: TensorSource, done: ReadDone) -> int:
        seen.append([n for n, _ in branch])
        return 0

    with pytest.raises(RuntimeError, match="gather failed"):
        fan_out(broken(), [consume, consume])
