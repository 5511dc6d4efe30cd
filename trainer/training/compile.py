"""The compiled training step: regional compilation of the decoder layers, and what compiling costs.

On CUDA the eager step spends more time in unfused elementwise kernels (norms, activations, RoPE,
casts) than in its matmuls at small widths; compiling each decoder layer fuses them
(``nn.Module.compile``; every layer runs the same code, so the layers share their compiled graphs).
Rows change length at every step. By default (``AsyncGRPOConfig.compile_row_bucket``) each row is
padded up to a multiple of a bucket of tokens (:meth:`~trainer.training.packing.PackedRow.padded_to_multiple`)
and the layers are compiled for static shapes: one compilation per bucket a run reaches, at most
``token_budget / bucket``, and 3-6 points more hardware FLOP utilisation than one dynamic-shape graph
on one H200 (``bench/packing/README.md``). With ``compile_row_bucket=None`` the layers are compiled
with ``dynamic=True`` instead: the sequence length is symbolic from the first compile and any row
length reuses the graph. The fused LM-head loss is compiled separately, with dynamic shapes
(:mod:`trainer.training.logprobs`).

:class:`CompileTracker` turns compilation into metrics instead of silent stalls: the seconds spent
compiling and the number of compilations of each step go to ``perf/compile_s`` and
``perf/compile_count`` (both shown by the progress display at each log), and a log line says when
a compilation starts. Triton autotuning outside torch's compiler counts as compilation too: a kernel
tuned at its first call for a new key (``fla``'s Gated DeltaNet kernels: each of their configs
compiled and benchmarked, minutes in all from an empty cache on one H200) adds its seconds and one
compilation, and each tuning of a second or more is logged as it ends.

CPU keeps the eager step: compiling there needs a C++ toolchain at run time and was not measured
faster on the tiny models this machine trains.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.training.packing import PackedRow
from trainer.training.tree_attention import unwrap_model

__all__ = ["CompileTracker", "RowBuckets", "compile_decoder_layers", "decoder_layers", "use_compiled_step"]

logger = logging.getLogger(__name__)

TuningListener = Callable[[str, float], None]
_tuning_listeners: list[TuningListener] = []
_tuning_lock = threading.Lock()
_tuning_watched = False
_NOT_BENCHED = -1.0


def _timed_autotuner_run(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Autotuner.run`` that tells the listeners how long a call that benchmarked its configs took
    (Triton sets ``bench_time`` only then: not on a key already tuned, nor on a hit of its disk cache)."""

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _tuning_listeners:
            return original(self, *args, **kwargs)
        self.bench_time = _NOT_BENCHED
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        if getattr(self, "bench_time", _NOT_BENCHED) != _NOT_BENCHED:
            spent = time.perf_counter() - start  # each config's compilation, its benchmark, the chosen run
            name = str(getattr(getattr(self, "base_fn", None), "__name__", type(self).__name__))
            for listener in list(_tuning_listeners):
                listener(name, spent)
        return out

    return run


def watch_triton_autotuning(listener: TuningListener) -> bool:
    """Call ``listener(kernel name, seconds)`` after each Triton autotuning that benchmarked (wraps
    ``triton.runtime.autotuner.Autotuner.run`` once per process; fla's autotuners subclass it).

    Returns:
        Whether Triton is importable (without it nothing is tuned, and nothing is watched).
    """
    global _tuning_watched
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return False
    with _tuning_lock:
        if not _tuning_watched:
            Autotuner.run = _timed_autotuner_run(Autotuner.run)  # type: ignore[method-assign]
            _tuning_watched = True
        _tuning_listeners.append(listener)
    return True


def unwatch_triton_autotuning(listener: TuningListener) -> None:
    """Stop calling ``listener``; idempotent."""
    with _tuning_lock:
        if listener in _tuning_listeners:
            _tuning_listeners.remove(listener)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: modules whose class is in its ``_no_split_modules`` (for a PEFT
    model, its base model's)."""
    inner = unwrap_model(model)
    base = getattr(inner, "get_base_model", None)
    if callable(base):
        inner = base()
    names = set(getattr(inner, "_no_split_modules", None) or [])
    return [m for m in inner.modules() if type(m).__name__ in names]


def compile_decoder_layers(model: nn.Module, dynamic: bool = True) -> int:
    """Compile each decoder layer in place (``layer.compile(dynamic=...)``); returns how many.

    Compilation is lazy: the first forward of each new graph pays it (see :class:`CompileTracker`).
    """
    layers = decoder_layers(model)
    for layer in layers:
        # Inductor keeps a fused kernel's intermediates in float32 unless told to round them as eager
        # does; measured on one H200 (bf16, 4-layer Qwen3 row), that put some rows' gradients 3x
        # further from a float32 step than eager's. Rounding like eager makes compiled match eager.
        layer.compile(dynamic=dynamic, options={"emulate_precision_casts": True})
    return len(layers)


class RowBuckets:
    """Pads each row up to a multiple of ``bucket`` tokens for layers compiled with static shapes, and
    keeps dynamo's ``recompile_limit`` above the number of buckets seen.

    Every decoder layer runs the same code, and dynamo's limit (8 by default) counts graphs per code
    object: past it, it runs that code eagerly from then on, silently slower. Static shapes make one
    graph per bucket, so the limit grows with the buckets a run reaches (plus headroom for other
    guards).
    """

    def __init__(self, bucket: int) -> None:
        self.bucket = bucket
        self.lengths: set[int] = set()

    def __call__(self, row: PackedRow) -> PackedRow:
        """``row`` padded to its bucket (:meth:`PackedRow.padded_to_multiple`)."""
        padded = row.padded_to_multiple(self.bucket)
        self.lengths.add(int(padded.input_ids.numel()))
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(int(dynamo_config.recompile_limit), len(self.lengths) + 4)
        return padded


class CompileTracker:
    """Counts compilations and the seconds spent in them, from torch's compile callbacks.

    Dynamo calls the start callback when the first of possibly nested compilations begins and the
    end callback when the last one ends, so the time is wall-clock time spent compiling (forward
    graphs, and backward graphs compiled lazily at their first backward). Triton autotuning that runs
    outside a compilation (:func:`watch_triton_autotuning`) adds its seconds and one compilation per
    tuned kernel.

    Args:
        announce: Log a line when a compilation starts (rank 0 of a run).
    """

    def __init__(self, announce: bool = True) -> None:
        from torch._dynamo.callback import callback_handler

        self._handler = callback_handler
        self._announce = announce
        self._lock = threading.Lock()
        self._started: float | None = None
        self._seconds = 0.0
        self._count = 0
        self.total_count = 0
        self.total_s = 0.0
        self.tuned = 0
        """Triton kernels autotuned since this tracker was made (their seconds are in ``total_s``)."""
        self._graphs_at_start = self._graph_counter()
        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)
        watch_triton_autotuning(self._on_tuned)

    @staticmethod
    def _graph_counter() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    @property
    def graphs(self) -> int:
        """Graphs dynamo compiled since this tracker was made (forward graphs; their backward is
        compiled with them, at the first backward)."""
        return self._graph_counter() - self._graphs_at_start

    def _on_start(self, *args: Any) -> None:
        with self._lock:
            self._started = time.perf_counter()
            self._count += 1
            self.total_count += 1
        if self._announce:
            logger.info("compiling the training step (compilation %d of this run; the step waits for it)",
                        self.total_count)

    def _on_end(self, *args: Any) -> None:
        with self._lock:
            if self._started is not None:
                spent = time.perf_counter() - self._started
                self._seconds += spent
                self.total_s += spent
                self._started = None

    def _on_tuned(self, kernel: str, seconds: float) -> None:
        with self._lock:
            if self._started is not None:  # tuned inside a compilation: its seconds are counted there
                return
            self._seconds += seconds
            self.total_s += seconds
            self._count += 1
            self.total_count += 1
            self.tuned += 1
        if self._announce and seconds >= 1.0:
            logger.info("tuned Triton kernel %s in %.1f s (autotuning at its first use on this machine; the step "
                        "waits; kept in the compile cache): %d kernels tuned, %.1f s compiling in all",
                        kernel, seconds, self.tuned, self.total_s)

    def take(self) -> tuple[float, int]:
        """Seconds spent compiling and compilations started since the last call."""
        with self._lock:
            out = (self._seconds, self._count)
            self._seconds, self._count = 0.0, 0
        return out

    def close(self) -> None:
        """Unregister the callbacks; idempotent."""
        unwatch_triton_autotuning(self._on_tuned)
        for remove, cb in ((self._handler.remove_start_callback, self._on_start),
                           (self._handler.remove_end_callback, self._on_end)):
            try:
                remove(cb)
            except ValueError:  # already removed
                pass


def use_compiled_step(requested: bool, device: torch.device) -> bool:
    """Whether the step is compiled: requested (``compile_training_step``) and on CUDA."""
    return bool(requested) and device.type == "cuda"
