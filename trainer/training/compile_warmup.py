"""Compiling the step off the critical path: the expected row shapes compile while the first rollouts
are generated.

A run's first step cannot start before its first batch is generated, and with a compiled step its
first rows would then wait for their compilation (about 10 s per row bucket from a cold cache on one
H200, about 1 s from a warm one; ``bench/packing/README.md``). :class:`CompileWarmUp` spends the wait
instead: when training begins it forwards and backpropagates synthetic rows of each expected length
in a background thread, so the layers' graphs (and FlexAttention's and the head loss's kernels) are
compiled, or loaded from the compile cache (:mod:`trainer.training.compile_cache`), by the time the
first batch arrives. The expected lengths are the row buckets from the token budget down (the row
planner fills rows to the budget, so the largest buckets come first); with dynamic shapes one row.

The warm-up stops when the first step begins: the row in flight finishes (a compilation cannot be
interrupted) and the rest compile lazily, as without a warm-up. The synthetic rows change no weight:
their gradients are dropped, no optimizer step runs. Single-process runs only: with several
processes a forward runs collectives, which a background thread would interleave with the main
thread's; those runs rely on the compile cache alone.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from torch import nn
from transformers import TrainerCallback

from trainer.records import TrainingSample, TrainingSequence
from trainer.training.compile import CompileTracker
from trainer.training.loss import LossConfig, packed_grpo_loss
from trainer.training.packing import PackedRow, build_row

__all__ = ["CompileWarmUp", "expected_lengths", "grpo_step", "warm_up_row"]

logger = logging.getLogger(__name__)


def expected_lengths(token_budget: int | None, bucket: int | None) -> list[int]:
    """The row lengths a run's compiled step will meet, most likely first.

    Args:
        token_budget: Most forwarded tokens in a row (``None``: unknown, nothing expected).
        bucket: ``compile_row_bucket`` (``None``: dynamic shapes, one graph for every length).

    Returns:
        Each bucket from the one holding ``token_budget`` down to ``bucket``; with dynamic shapes,
        ``[token_budget]``.
    """
    if not token_budget:
        return []
    if bucket is None:
        return [token_budget]
    return [k * bucket for k in range(math.ceil(token_budget / bucket), 0, -1)]


def warm_up_row(length: int, vocab_size: int) -> PackedRow:
    """A GRPO-like row of ``length - 1`` or ``length`` forwarded tokens (``length >= 5``): one prompt and
    two completions (every completion token trained), so that padded to its bucket it is ``length`` long."""
    prompt = max(1, length // 2)
    completion = max(1, (length - prompt - 1) // 2)  # the prompt's last token is forwarded once per branch
    prompt_ids = [(7 * i + 3) % vocab_size for i in range(prompt)]
    mask = [0] * prompt + [1] * completion
    samples = []
    for branch in range(2):  # completions that differ from their first token: two branches
        ids = prompt_ids + [(11 * j + 5 + branch) % vocab_size for j in range(completion)]
        samples.append(TrainingSample(TrainingSequence(ids, mask, [-1.0 * m for m in mask]),
                                      advantage=1.0 - 2 * branch, group_id=0, policy_version=0))
    return build_row(samples)


def grpo_step(model: nn.Module, temperature: float,
              context: Callable[[], AbstractContextManager[Any]] = nullcontext) -> Callable[[PackedRow], None]:
    """The training step's forward and backward of one row (``packed_grpo_loss`` under ``context``, the
    trainer's loss context), for :class:`CompileWarmUp`. The loss's settings change no compiled graph."""

    def step(row: PackedRow) -> None:
        with context():
            loss, _ = packed_grpo_loss(model, row, temperature, LossConfig(), row.num_trained)
        torch.autograd.backward(loss)

    return step


class CompileWarmUp(TrainerCallback):
    """Compiles the step for the expected row lengths in a background thread, from ``on_train_begin``
    until ``on_step_begin`` (see the module's docstring).

    Args:
        model: The trained model (its gradients are dropped after each synthetic row).
        step: Forward and backward of one row, as the training step runs it (loss context, loss).
        lengths: Called when training begins (the token budget is known then): the lengths to compile,
            in order (:func:`expected_lengths`).
        pad: What the training step does to a row before its forward (``RowBuckets``), if anything.
        device: Where the rows go.
        tracker: The step's :class:`CompileTracker`: the warm-up's compilations are taken out of it
            (the first step did not wait for them) and logged.
    """

    def __init__(self, model: nn.Module, step: Callable[[PackedRow], None], lengths: Callable[[], Sequence[int]],
                 pad: Callable[[PackedRow], PackedRow] | None = None, device: Any = None,
                 tracker: CompileTracker | None = None) -> None:
        self._model = model
        self._step = step
        self._lengths = lengths
        self._pad = pad
        self._device = device
        self._tracker = tracker
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.compiled: list[int] = []
        """The lengths compiled (or loaded from the cache) before the first step."""
        self.seconds = 0.0
        """Wall-clock seconds the warm-up ran."""

    def start(self) -> None:
        """Start the background thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(list(self._lengths()),),
                                            name="compile-warm-up", daemon=True)
            self._thread.start()

    def wait(self) -> None:
        """Wait until every length is compiled (or the warm-up was stopped)."""
        if self._thread is not None:
            self._thread.join()

    def request_stop(self) -> None:
        """Ask the thread to stop after the row in flight, without waiting."""
        self._stopping.set()

    def stop(self) -> None:
        """Stop after the row in flight and wait for it; idempotent."""
        self.request_stop()
        self.wait()

    def _run(self, lengths: list[int]) -> None:
        start = time.perf_counter()
        embeddings = cast(nn.Embedding, cast(Any, self._model).get_input_embeddings())
        vocab_size = int(embeddings.weight.shape[0])
        try:
            for length in lengths:
                if self._stopping.is_set():
                    break
                row = warm_up_row(length, vocab_size).to(self._device)
                self._step(self._pad(row) if self._pad is not None else row)
                self._model.zero_grad(set_to_none=True)
                self.compiled.append(length)
        except Exception:  # the first real step meets the same problem and reports it
            logger.warning("compile warm-up stopped by an error (the training step compiles lazily instead)",
                           exc_info=True)
            self._model.zero_grad(set_to_none=True)
        self.seconds = time.perf_counter() - start
        compile_s, count = self._tracker.take() if self._tracker is not None else (0.0, 0)
        if lengths:
            logger.info("compile warm-up: %d of %d row lengths ready before the first step (%d compilations, "
                        "%.1f s compiling, %.1f s in all, while the first rollouts were generated)",
                        len(self.compiled), len(lengths), count, compile_s, self.seconds)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """Start compiling while the rollout worker generates the first batch."""
        self.start()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """The first batch has arrived: stop warming up before the step touches the model."""
        self.stop()

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """A run that ends before its first step still leaves no thread behind."""
        self.stop()
