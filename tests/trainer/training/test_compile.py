"""The compile tracker's accounting of Triton autotuning (``trainer/training/compile.py``): a kernel
tuned at its first call for a key (fla's Gated DeltaNet kernels) is compilation, not a silent stall.
Triton is not installed here, so a stand-in ``triton.runtime.autotuner.Autotuner`` with Triton's
contract (``bench_time`` set only when the configs were benchmarked) takes its place."""

from __future__ import annotations

import logging
import sys
import time
from types import ModuleType
from typing import Any

import pytest

from trainer.training import compile as compile_module
from trainer.training.compile import CompileTracker


class FakeAutotuner:
    """Triton's contract: configs benchmarked (``bench_time`` set) only for a key not yet tuned."""

    def __init__(self, name: str, tuning_s: float) -> None:
        self.base_fn = type(name, (), {})  # a jitted function: it has a __name__
        self.cache: dict[int, str] = {}
        self.tuning_s = tuning_s

    def run(self, key: int) -> str:
        if key not in self.cache:
            time.sleep(self.tuning_s)
            self.bench_time = self.tuning_s
            self.cache[key] = "best"
        return self.cache[key]


class SubclassedAutotuner(FakeAutotuner):
    """As fla's ``CachedAutotuner``: overrides ``run`` and calls the base class's."""

    def run(self, key: int) -> str:
        return super().run(key)


@pytest.fixture
def fake_triton(monkeypatch: pytest.MonkeyPatch) -> type[FakeAutotuner]:
    autotuner = ModuleType("triton.runtime.autotuner")
    autotuner.Autotuner = FakeAutotuner  # type: ignore[attr-defined]
    for name, module in (("triton", ModuleType("triton")), ("triton.runtime", ModuleType("triton.runtime")),
                         ("triton.runtime.autotuner", autotuner)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(FakeAutotuner, "run", FakeAutotuner.run)  # restored after the test
    monkeypatch.setattr(compile_module, "_tuning_watched", False)
    monkeypatch.setattr(compile_module, "_tuning_listeners", [])
    return FakeAutotuner


def test_autotuning_counts_as_compilation_once_per_key(fake_triton: type[FakeAutotuner],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    tracker = CompileTracker(announce=True)
    try:
        fast, slow = fake_triton("chunk_fwd_o", 0.01), SubclassedAutotuner("chunk_bwd_dqkwg", 1.0)
        with caplog.at_level(logging.INFO, logger="trainer.training.compile"):
            fast.run(0)
            slow.run(0)
            seconds, count = tracker.take()
            fast.run(0)  # tuned already: neither a compilation nor seconds
            slow.run(0)
            assert tracker.take() == (0.0, 0)
            fast.run(1)  # a new key is tuned again
            assert tracker.take()[1] == 1
    finally:
        tracker.close()
    assert count == 2 and seconds >= 1.0 and tracker.tuned == 3 and tracker.total_count == 3
    tuned = [r.getMessage() for r in caplog.records if "tuned Triton kernel" in r.getMessage()]
    assert len(tuned) == 1 and "chunk_bwd_dqkwg" in tuned[0]  # only tunings of a second or more are logged
    fast.run(2)  # after close: not counted
    assert tracker.take() == (0.0, 0)


def test_tuning_inside_a_compilation_is_counted_once(fake_triton: type[FakeAutotuner]) -> None:
    tracker = CompileTracker(announce=False)
    try:
        tracker._on_start()
        fake_triton("kernel", 0.0).run(0)
        tracker._on_end()
        _, count = tracker.take()
    finally:
        tracker.close()
    assert count == 1 and tracker.tuned == 0


def test_without_triton_nothing_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # import fails as if not installed
    calls: list[Any] = []
    assert compile_module.watch_triton_autotuning(lambda *a: calls.append(a)) is False
