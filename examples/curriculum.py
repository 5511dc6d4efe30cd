"""A curriculum through the rollout-loop hooks: stop sampling prompts the policy has solved.

TRL's "Customizing the rollout loop" example, runnable. ``CurriculumRolloutLoop`` subclasses
``AsyncRolloutLoop`` and overrides two hooks:

* ``compute_advantages(group)`` records each prompt's pass rate (the share of its rollouts with a
  reward above 0), then returns the default advantages. It runs for every group, also for one whose
  rewards are all equal and which is then dropped: exactly the solved prompts.
* ``filter_prompt(row_index, row, epoch)`` skips a prompt whose pass rate reached
  ``pass_rate_cap``, a field of ``CurriculumConfig`` (a config subclass carries the loop's settings;
  the trainer hands it to the loop through ``rollout_loop_kwargs()``, as the loop gets the run's
  ``RolloutSettings``, not the config).
  A skipped prompt counts as consumed for the epoch; rejecting every prompt of an epoch raises.

``CurriculumTrainer`` sets ``loop_cls = CurriculumRolloutLoop``; the trainer's constructor is
unchanged. The loop is built in the spawned rollout worker, so the classes are module-level and the
training code sits under ``if __name__ == "__main__":``. The hooks log their own metrics with
``self.log_metric`` / ``self.log_rate``, which reach the trainer's logs with the built-in ones:
``curriculum/skipped_count`` (prompts skipped in the window), ``curriculum/solved_frac`` (groups
whose pass rate reached the cap, over groups scored) and ``curriculum/pass_rate`` (mean pass rate).

The task: "describe a topic in at most N words", N from 2 to 64. ``word_budget_reward`` gives 1.0
within the budget and ``-(excess words / words)`` beyond it, so short budgets are hard, long ones
easy, and an over-budget group still has reward spread to learn from.

Start a vLLM server on the model, then run::

    toolgym vllm models/Qwen3-0.6B --port 8000 --max-model-len 4096
    python examples/curriculum.py --model models/Qwen3-0.6B --vllm-url http://localhost:8000 \\
        --max-steps 200 --output-dir outputs/curriculum --pass-rate-cap 0.9
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np
from datasets import Dataset

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.async_grpo_trainer import AsyncRolloutLoop, RolloutGroup

TOPICS = ("the sea", "a city at night")
LIMITS = (2, 4, 8, 16, 32, 64)


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    """``AsyncGRPOConfig`` plus the curriculum's threshold."""

    pass_rate_cap: float = 0.9  # a prompt whose rollouts pass this often is not sampled again


class CurriculumRolloutLoop(AsyncRolloutLoop):
    """Skips the prompts whose last group passed at least ``pass_rate_cap`` of the time."""

    def __init__(self, *args: Any, pass_rate_cap: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pass_rate_cap = pass_rate_cap

    async def setup(self) -> None:
        self.pass_rates: dict[int, float] = {}

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        keep = self.pass_rates.get(row_index, 0.0) < self.pass_rate_cap
        if not keep:
            self.log_metric("curriculum/skipped_count", 1)  # summed over the logging window ("count")
        return keep

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            pass_rate = float(np.mean(scored > 0))
            self.pass_rates[group.row_index] = pass_rate
            self.log_metric("curriculum/pass_rate", pass_rate)  # averaged over the window
            self.log_rate("curriculum/solved_frac", pass_rate >= self.pass_rate_cap, 1)
        return super().compute_advantages(group)


class CurriculumTrainer(AsyncGRPOTrainer):
    """``AsyncGRPOTrainer`` whose rollout worker runs ``CurriculumRolloutLoop``."""

    args: CurriculumConfig
    loop_cls = CurriculumRolloutLoop

    def rollout_loop_kwargs(self) -> dict[str, Any]:
        """The loop's own setting, from the config."""
        return {"pass_rate_cap": self.args.pass_rate_cap}


def word_budget_reward(completions: list[list[dict[str, Any]]], limit: list[int], **kwargs: Any) -> list[float]:
    """1.0 for an answer of at most ``limit`` words, else -(excess words / words), in (-1, 0)."""
    rewards = []
    for completion, budget in zip(completions, limit, strict=True):
        text = next((m.get("content") or "" for m in reversed(completion) if m.get("role") == "assistant"), "")
        words = len(text.split())
        rewards.append(1.0 if words <= budget else -(words - budget) / words)
    return rewards


def build_dataset() -> Dataset:
    """Every topic with every word budget; the budget is also the ``limit`` column the reward reads."""
    rows = [(topic, limit) for topic in TOPICS for limit in LIMITS]
    prompts = [[{"role": "user", "content": f"Describe {topic} in at most {limit} words."}] for topic, limit in rows]
    return Dataset.from_dict({"prompt": prompts, "limit": [limit for _, limit in rows]})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="local model directory (saved with save_pretrained), the one the vLLM server serves")
    parser.add_argument("--vllm-url", default="http://localhost:8000", help="base URL of the vLLM server")
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps; -1 trains num_train_epochs")
    parser.add_argument("--output-dir", default="outputs/curriculum")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--pass-rate-cap", type=float, default=0.9)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> CurriculumTrainer:
    """Train with the curriculum loop; returns the trainer."""
    args = parse_args(argv)
    config = CurriculumConfig(
        output_dir=args.output_dir, vllm_server_base_url=args.vllm_url, max_steps=args.max_steps,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        pass_rate_cap=args.pass_rate_cap, num_train_epochs=20,
    )
    trainer = CurriculumTrainer(
        model=args.model, reward_funcs=word_budget_reward, args=config, train_dataset=build_dataset())
    trainer.train()
    return trainer


if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    main()
