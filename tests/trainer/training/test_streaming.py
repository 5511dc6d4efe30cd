"""Streaming datasets (``datasets.IterableDataset``): they train, epochs count distinct prompts, a resume
restarts the stream at its first prompt."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset, IterableDataset

from tests.trainer.test_async_trainer import recording_reward
from tests.trainer.test_metric_definitions import QueueSource, _group
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import RolloutWorkerError
from trainer.launch.vllm_server import VLLMServer
from trainer.metrics import MetricWindow
from trainer.rollout.prompt_order import first_row_columns, is_stream, map_style_rows, stream_rows
from trainer.sync.weight_sync import WeightSynchronizer
from trainer.training.batching import MicroBatchStream

N = 6


def _rows() -> dict[str, list[Any]]:
    return {"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(N)], "row_id": list(range(N))}


def _stream() -> IterableDataset:
    return Dataset.from_dict(_rows()).to_iterable_dataset(num_shards=2).shuffle(seed=3, buffer_size=4)


def test_a_stream_is_iterated_pass_after_pass_and_its_size_reported_before_the_second() -> None:
    reported: list[int] = []
    rows = stream_rows(_stream(), reported.append)
    first = [next(rows) for _ in range(N)]
    assert reported == []
    seventh = next(rows)
    assert reported == [N]
    second = [seventh] + [next(rows) for _ in range(N - 1)]
    assert sorted(r[2]["row_id"] for r in first) == sorted(r[2]["row_id"] for r in second) == list(range(N))
    assert [r[0] for r in first + second] == list(range(2 * N)) and {r[3] for r in second} == {1}
    assert [r[2]["row_id"] for r in first] != [r[2]["row_id"] for r in second]  # set_epoch reshuffles
    assert is_stream(_stream()) and not is_stream(Dataset.from_dict(_rows()))


def test_an_empty_stream_stops_the_worker() -> None:
    def nothing() -> Any:
        yield from ()

    empty = IterableDataset.from_generator(nothing)
    with pytest.raises(RolloutWorkerError, match="yielded no prompt"):
        next(stream_rows(empty, lambda size: None))


def test_columns_of_a_stream_from_a_generator() -> None:
    def rows() -> Any:
        yield from ({"prompt": p, "row_id": i} for i, p in enumerate(_rows()["prompt"]))

    stream = IterableDataset.from_generator(rows)
    assert stream.column_names is None and first_row_columns(stream) == ["prompt", "row_id"]


def test_map_style_rows_resume_at_a_position() -> None:
    rows = map_style_rows(Dataset.from_dict(_rows()), seed=0, start_position=4)
    assert [next(rows)[0] for _ in range(3)] == [4, 5, 6]


class SizedQueueSource(QueueSource):
    """A group source whose worker knows the epoch size."""

    def epoch_size(self) -> int | None:
        """The stream's first pass has ended."""
        return 2


def test_the_stream_stops_at_epochs_times_the_reported_size() -> None:
    source = SizedQueueSource([_group(p, 1, 0, 1.0, {}) for p in range(4)])
    stream = MicroBatchStream(source, num_rows=1, token_budget=1000, max_staleness=2, metrics=MetricWindow(),
                              stop_epochs=1.5)
    batch = next(stream)
    assert stream.stop_position == 3 and batch.num_samples == 3  # position 3 is past 1.5 epochs: not trained
    assert stream.epoch_done


@pytest.mark.vllm
def test_an_iterable_dataset_trains_one_epoch_and_a_resume_restarts_it(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    scored = tmp_path / "scored.txt"
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=vllm_server.base_url, num_train_epochs=1,
        num_generations=4, max_completion_length=16, learning_rate=1e-3, report_to="none", use_cpu=True,
        gradient_checkpointing=False, save_strategy="no", rollout_worker_timeout=60, vllm_server_timeout=60,
        disable_tqdm=True, max_staleness=1)
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), train_dataset=_stream(), args=args,
                               reward_funcs=functools.partial(recording_reward, path=str(scored)))
    trainer.train()
    assert trainer.stream.stop_position == N and trainer.stream.epoch_done
    assert trainer.state.global_step >= 1 and trainer.state.epoch == pytest.approx(1.0)
    assert set(range(N)) <= {int(line) for line in scored.read_text().split()}  # every prompt of the pass

    trainer._resume_state = {"first_untrained_position": 4, "done_positions": [5], "policy_version": 0}
    with caplog.at_level(logging.WARNING, logger="trainer.async_grpo_trainer"):
        try:
            stream = trainer.get_train_dataloader()
        finally:
            trainer._shutdown()
    assert stream.progress.first_untrained == 0 and stream.stop_position is None
    assert any("starts again from its first prompt" in r.getMessage() for r in caplog.records)
