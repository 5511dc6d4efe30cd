"""Compiling off the critical path (``trainer/training/compile_warmup.py``) and the progress table's
compile column. On CPU the step is eager, so these check what the warm-up runs and leaves behind;
that it compiles what the first step then needs is checked on the GPU (``test_compile_cuda.py``)."""

from __future__ import annotations

import io
import logging
import threading
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.reporting import ProgressCallback
from trainer.training.compile import RowBuckets
from trainer.training.compile_warmup import CompileWarmUp, expected_lengths, grpo_step, warm_up_row
from trainer.training.packing import PackedRow
from trainer.training.tree_attention import enable_tree_attention


def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return enable_tree_attention(Qwen3ForCausalLM(config).float())


def test_expected_lengths_are_the_buckets_from_the_budget_down() -> None:
    assert expected_lengths(4000, 1024) == [4096, 3072, 2048, 1024]
    assert expected_lengths(4096, 1024)[0] == 4096
    assert expected_lengths(500, 1024) == [1024]
    assert expected_lengths(4000, None) == [4000]  # dynamic shapes: one graph for every length
    assert expected_lengths(None, 1024) == []


@pytest.mark.parametrize("bucket", [8, 64, 1024])
def test_a_warm_up_row_padded_to_its_bucket_is_the_bucket_length(bucket: int) -> None:
    for length in expected_lengths(4 * bucket, bucket):
        row = warm_up_row(length, vocab_size=64)
        assert length - 1 <= row.num_unique_tokens <= length and row.num_trained > 0
        assert RowBuckets(bucket)(row).input_ids.numel() == length


def test_the_warm_up_runs_the_step_on_each_length_and_leaves_no_gradient() -> None:
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    buckets = RowBuckets(16)
    seen: list[int] = []
    real_step = grpo_step(model, temperature=1.0)

    def step(row: PackedRow) -> None:
        seen.append(row.input_ids.numel())
        real_step(row)
        assert any(p.grad is not None for p in model.parameters())  # a real backward ran

    warm = CompileWarmUp(model, step, lambda: expected_lengths(60, 16), pad=buckets)
    warm.on_train_begin(None, None, None)
    warm.wait()  # a first batch that takes longer than the warm-up
    warm.on_step_begin(None, None, None)
    assert seen == warm.compiled == [64, 48, 32, 16]
    assert buckets.lengths == {64, 48, 32, 16}
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_first_step_stops_it_after_the_row_in_flight() -> None:
    model = tiny_model()
    seen: list[int] = []

    def step(row: PackedRow) -> None:
        seen.append(row.input_ids.numel())
        warm.request_stop()  # the first batch arrives while this row compiles

    warm = CompileWarmUp(model, step, lambda: [48, 32, 16])
    warm.start()
    warm.stop()
    assert seen == [47] and warm.compiled == [48]  # the row unpadded (no bucket given), the length asked
    warm.on_train_end(None, None, None)  # idempotent


def test_an_error_in_the_warm_up_is_logged_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model()
    stepped = threading.Event()

    def step(row: PackedRow) -> None:
        torch.stack([p.sum() for p in model.parameters()]).sum().backward()
        stepped.set()
        raise torch.OutOfMemoryError("no room")

    warm = CompileWarmUp(model, step, lambda: [32, 16])
    with caplog.at_level(logging.WARNING):
        warm.start()
        warm.stop()
    assert stepped.is_set() and warm.compiled == []
    assert "compile warm-up stopped by an error" in caplog.text
    assert all(p.grad is None for p in model.parameters())


def _progress(logs: dict[str, float]) -> str:
    callback = ProgressCallback()
    callback.console = Console(file=io.StringIO(), width=200, highlight=False)
    callback.on_log(None, SimpleNamespace(global_step=3, is_world_process_zero=True), None, logs={"loss": 0.1, **logs})
    return str(callback.console.file.getvalue())


def test_the_progress_table_shows_the_seconds_a_step_waited_for_compilation() -> None:
    header, row = _progress({"perf/step_s": 14.0, "perf/compile_s": 12.34, "perf/compile_count": 2}).splitlines()
    assert header.split()[-2:] == ["compile", "s"] and row.split()[-1] == "12.3"
    assert len(header) == len(row)  # cells under their titles
    _, row = _progress({"perf/step_s": 1.5, "perf/compile_s": 0.0, "perf/compile_count": 0}).splitlines()
    assert row.split()[-2:] == ["1.5", "-"]


def test_a_row_stays_one_line_in_a_narrow_log_file() -> None:
    callback = ProgressCallback()
    callback.console.file = io.StringIO()  # not a terminal: rich's width is 80, narrower than a full row
    logs = {"loss": 0.1, "reward": 0.5, "perf/step_s": 14.0, "perf/compile_s": 12.3, "perf/compile_count": 2}
    callback.on_log(None, SimpleNamespace(global_step=3, is_world_process_zero=True), None, logs=logs)
    header, row = str(callback.console.file.getvalue()).splitlines()
    assert len(header) > 80 and header.split()[-2:] == ["compile", "s"] and row.split()[-1] == "12.3"
