"""End to end: a dataset run scored by ``accuracy_reward`` on the real vLLM CPU server.

The shared session server is switched to a warm-started model through a real weight sync (and put
back afterwards by ``restore_served_weights``). The counter learning experiment (the env server,
the worker and vLLM, +10 points at least) is ``make demo`` itself, run and checked by
``tests/test_readme.py``; ``bench/e2e/learning_sweep.py`` measured it on four seeds.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from datasets import Dataset

from toolgym.kit.counter_experiment import serve_policy
from toolgym.kit.warm_start import arithmetic_prompt
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer
from trainer.rewards import accuracy_reward
from trainer.sync.weight_sync import WeightSynchronizer


def _arithmetic_dataset(n: int = 64, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 5), rng.randint(0, 5)) for _ in range(n)]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": arithmetic_prompt(a, b)}] for a, b in pairs],
        "solution": [str(a + b) for a, b in pairs],
    })


def test_arithmetic_run_is_scored_by_accuracy_reward(
    vllm_server: VLLMServer, warm_arithmetic_model_dir: Path, restore_served_weights: WeightSynchronizer,
    tmp_path: Path,
) -> None:
    serve_policy(vllm_server.base_url, warm_arithmetic_model_dir)
    steps = 4
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=vllm_server.base_url, max_steps=steps,
        num_generations=8, max_completion_length=24, learning_rate=2e-4, gradient_accumulation_steps=2,
        use_cpu=True, gradient_checkpointing=False, save_strategy="no", report_to="none", disable_tqdm=True)
    trainer = AsyncGRPOTrainer(model=str(warm_arithmetic_model_dir), reward_funcs=accuracy_reward, args=config,
                               train_dataset=_arithmetic_dataset())
    trainer.train()

    # A step logs the reward metrics of the groups it received (they travel with the group); a step
    # that trains only samples held over from the previous one receives none, so not every step has
    # them (the closing summary may carry the last window's metrics too: not a step).
    logged = [h for h in trainer.state.log_history if "rewards/accuracy_reward/mean" in h and "loss" in h]
    assert 1 <= len(logged) <= steps
    accuracy = [h["rewards/accuracy_reward/mean"] for h in logged]
    assert all(0.0 <= a <= 1.0 for a in accuracy)
    assert 0.0 < sum(accuracy) / len(logged) < 1.0, f"some answers right, some wrong: {accuracy}"
    assert [h["reward"] for h in logged] == pytest.approx(accuracy)  # the only reward source
    assert trainer.stream.policy_version == steps  # one weight sync per optimizer step
