"""``log_completions`` / ``num_completions_to_print``: a real short run shows its completions on the
console and in TensorBoard (the real vLLM CPU server and rollout worker)."""

from __future__ import annotations

from pathlib import Path

import pytest
from datasets import Dataset

from tests.trainer.spread_reward import token_reward
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import ConfigError
from trainer.launch.vllm_server import VLLMServer
from trainer.reporting import CompletionRecord, completions_markdown
from trainer.sync.weight_sync import WeightSynchronizer


def test_completions_are_printed_and_sent_to_tensorboard(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    restore_served_weights: WeightSynchronizer,
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=vllm_server.base_url, max_steps=2,
        num_generations=4, max_completion_length=16, report_to=["tensorboard"],
        use_cpu=True, gradient_checkpointing=False, save_strategy="no", rollout_worker_timeout=300,
        vllm_server_timeout=60, disable_tqdm=True, log_completions=True, num_completions_to_print=2,
    )
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Spell the word zebra{i}."}]
                                         for i in range(12)]})
    AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=token_reward, args=args, train_dataset=data).train()

    out = capsys.readouterr().out
    assert out.count("completions at step") == 2  # one table per log
    assert "zebra" in out and "advantage" in out  # the prompt text is decoded
    runs = list((tmp_path / "out").rglob("events.out.tfevents.*"))
    assert runs, "TensorBoard wrote no event file"
    events = EventAccumulator(str(runs[0].parent), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("completions/text_summary")
    assert [t.step for t in texts] == [1, 2]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert table.startswith("| step | prompt | completion | reward | advantage |")
    assert len(table.splitlines()) == 2 + 2  # header, rule, num_completions_to_print rows


def test_markdown_cells_stay_on_one_line() -> None:
    table = completions_markdown([CompletionRecord(3, "a|b", "line1\nline2", 1.0, -0.5)])
    assert table.splitlines()[2] == "| 3 | a\\|b | line1<br>line2 | 1 | -0.5 |"


def test_num_completions_to_print_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_completions_to_print=0 must be >= 1"):
        AsyncGRPOConfig(output_dir=str(tmp_path), num_completions_to_print=0, use_cpu=True)
