"""Evaluation during training: eval_dataset, eval_strategy / eval_steps / eval_on_start, eval_* fields.

The real run trains the warm counter model for two steps against the shared vLLM CPU server, the rollout
worker running the evaluation episodes beside training's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

from environments.counter import IncrementEnv
from toolgym.kit.counter_experiment import counter_config, serve_policy
from trainer.async_grpo_trainer import AsyncGRPOTrainer
from trainer.config import AsyncGRPOConfig
from trainer.exceptions import ConfigError
from trainer.launch.vllm_server import VLLMServer
from trainer.rewards import tool_error_penalty
from trainer.rollout.eval_in_training import EvalPlan, eval_rows
from trainer.rollout.eval_results import read_episodes
from trainer.sync.weight_sync import WeightSynchronizer

EVAL_ONLY_TARGET = 5


def test_eval_rows_come_from_the_dataset_or_seeded_episodes() -> None:
    data = Dataset.from_dict({"target": [1, 2, 3]})
    assert eval_rows(data, None, True) == [{"target": 1}, {"target": 2}, {"target": 3}]
    assert eval_rows(data.to_iterable_dataset(), 2, True) == [{"target": 1}, {"target": 2}]
    assert eval_rows(None, 3, True) == [{"seed": 0}, {"seed": 1}, {"seed": 2}]
    assert len(eval_rows(None, None, True)) == 16
    with pytest.raises(ConfigError, match="evaluation needs an eval_dataset"):
        eval_rows(None, None, False)
    with pytest.raises(ConfigError, match="eval_dataset holds no rows"):
        eval_rows(data.select([]), None, True)


def test_the_plan_takes_the_eval_fields_or_the_training_ones(tmp_path: Path) -> None:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations=4, temperature=0.7)
    plan = EvalPlan.from_config(args, [{"target": 1}])
    assert (plan.num_generations, plan.temperature, plan.success_threshold) == (4, 0.7, 1.0)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, eval_num_generations=2, eval_temperature=0.0,
                           eval_group_by="target", eval_success_threshold=0.5)
    plan = EvalPlan.from_config(args, [{"target": 1}])
    assert (plan.num_generations, plan.temperature, plan.group_by, plan.success_threshold) == (2, 0.0, "target", 0.5)


@pytest.mark.parametrize(("fields", "message"), [
    ({"eval_temperature": -0.5}, r"eval_temperature=-0.5 must be >= 0 \(0: greedy"),
    ({"eval_num_generations": 0}, r"eval_num_generations=0 must be >= 1"),
    ({"eval_num_rows": 0}, r"eval_num_rows=0 must be >= 1"),
])
def test_bad_eval_fields_are_refused(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **fields)


def test_eval_strategy_without_anything_to_evaluate_is_refused_by_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=1, eval_strategy="steps", eval_steps=1,
                           report_to="none")
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 2})
    with pytest.raises(ConfigError, match="evaluation needs an eval_dataset"):
        AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                         args=args, train_dataset=data)


class _TrainedPrompts(TrainerCallback):  # type: ignore[misc]  # transformers' classes are untyped for mypy
    """Decodes every trained sample at each step's end (before the log takes them)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.trainer: AsyncGRPOTrainer | None = None
        self.texts: list[str] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        assert self.trainer is not None and self.trainer.stream is not None
        self.texts += [self.tokenizer.decode(s.sequence.input_ids) for s in self.trainer.stream.take_trained_samples()]


@pytest.mark.timeout(1200)
def test_evaluation_runs_beside_training_and_never_trains(
    vllm_server: VLLMServer, warm_counter_model_dir: Path, restore_served_weights: WeightSynchronizer, tmp_path: Path,
) -> None:
    serve_policy(vllm_server.base_url, warm_counter_model_dir)
    config = counter_config(tmp_path, vllm_server.base_url, steps=2, num_generations=4, log_completions=True,
                            num_completions_to_print=1, eval_strategy="steps", eval_steps=1, eval_on_start=True,
                            eval_num_generations=3, eval_group_by="target", max_staleness=1,
                            save_strategy="steps", save_steps=1, metric_for_best_model="success_rate",
                            greater_is_better=True, load_best_model_at_end=True)
    tokenizer = AutoTokenizer.from_pretrained(warm_counter_model_dir)
    trained = _TrainedPrompts(tokenizer)
    trainer = AsyncGRPOTrainer(
        model=str(warm_counter_model_dir), args=config, reward_funcs=tool_error_penalty, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"target": [1, 2] * 8}),  # training never sees the eval-only target
        eval_dataset=Dataset.from_dict({"target": [1, EVAL_ONLY_TARGET]}), environment_factory=IncrementEnv,
        callbacks=[trained])
    trained.trainer = trainer
    trainer.train()

    evals = [h for h in trainer.state.log_history if "eval_success_rate" in h]
    assert [h["step"] for h in evals] == [0, 1, 2]  # on start, then every step
    for h in evals:
        assert h["eval_episodes"] == 6 and 0 <= h["eval_success_rate_low"] <= h["eval_success_rate"] <= 1
        assert f"eval_task/target={EVAL_ONLY_TARGET}/success_rate" in h and "eval_pass@3" in h
    last = read_episodes(tmp_path / "eval" / "step-2")
    assert len(last) == 6 and {e.task for e in last} == {"target=1", f"target={EVAL_ONLY_TARGET}"}
    assert all(e.policy_version >= 1 for e in last)  # sampled from a trained policy version
    assert all(e.policy_version == 0 for e in read_episodes(tmp_path / "eval" / "step-0"))
    assert json.loads((tmp_path / "eval" / "step-1" / "summary.json").read_text())["run"]["step"] == 1
    assert trained.texts and not any(f"to {EVAL_ONLY_TARGET}." in text for text in trained.texts)
    assert any("to 1." in text or "to 2." in text for text in trained.texts)
    # transformers' best-checkpoint choice reads eval_success_rate: the best of the saved steps 1 and 2.
    best = max(evals[1:], key=lambda h: h["eval_success_rate"])
    assert trainer.state.best_metric == best["eval_success_rate"]
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best['step']}")
