"""Custom reward functions: examples 1, 2, 3 and 5 of TRL's "Using custom reward functions".

Four reward functions score every completion and the trainer sums them (each is logged as
``rewards/<function name>/mean``):

1. ``length_reward_func``: longer completions (in tokens) score higher (example 1);
2. ``format_reward_func``: ``<think>...</think><answer>...</answer>``, the DeepSeek-R1 format (example 2);
3. ``ground_truth_reward_func``: the ``\\boxed{}`` answer equals the dataset's ``ground_truth`` column
   (example 3: every dataset column except ``prompt`` reaches the reward functions by name);
4. ``async_reward_func``: an ``async def`` reward that awaits simulated I/O (example 5); async rewards
   are awaited together, sync ones run in threads, so their latencies overlap.

Example 4 (multi-task rewards returning ``None``) is ``examples/multi_task_rewards.py``. Reward
functions run in the spawned rollout worker: they are module-level functions (picklable), and the
training code sits under ``if __name__ == "__main__":`` because the worker re-imports this file.

Start a vLLM server on the model, then run (``--rewards`` picks a subset, e.g. ``format,ground_truth``)::

    toolgym vllm models/Qwen3-0.6B --port 8000 --max-model-len 4096
    python examples/custom_rewards.py --model models/Qwen3-0.6B --vllm-url http://localhost:8000 \\
        --max-steps 200 --output-dir outputs/custom_rewards

Offline, on the tiny local model (``toolgym tiny-model .cache/tiny-model`` builds it)::

    toolgym vllm .cache/tiny-model --port 8000
    python examples/custom_rewards.py --model .cache/tiny-model --max-steps 5
"""

from __future__ import annotations

import argparse
import asyncio
import re
from typing import Any

from datasets import Dataset

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer

# ---------------------------------------------------------------------------- example 1


def length_reward_func(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


# ---------------------------------------------------------------------------- example 2


def format_reward_func(completions: list[list[dict[str, str]]], **kwargs: Any) -> list[float]:
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# ---------------------------------------------------------------------------- example 3


def ground_truth_reward_func(
    completions: list[list[dict[str, str]]], ground_truth: list[str], **kwargs: Any
) -> list[float]:
    """1.0 when the content of ``\\boxed{}`` equals the row's ``ground_truth`` column, else 0.0."""
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion[0]["content"]) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth, strict=True)]


# ---------------------------------------------------------------------------- example 5


async def async_reward_func(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """An async reward: awaits a (simulated) I/O-bound call, then 1.0 for a non-empty completion."""
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


REWARDS = {
    "length": length_reward_func,
    "format": format_reward_func,
    "ground_truth": ground_truth_reward_func,
    "async": async_reward_func,
}

SYSTEM = ("Think inside <think></think>, then give the answer inside <answer></answer>, "
          "with the final value in \\boxed{}.")


def build_dataset() -> Dataset:
    """Linear equations ``a x + b = c`` with their integer solution in the ``ground_truth`` column."""
    prompts, truths = [], []
    for a in range(2, 7):
        for x in range(1, 11):
            b = (3 * a + x) % 9 + 1
            prompts.append([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"Solve the equation ${a}x + {b} = {a * x + b}$."}])
            truths.append(str(x))
    return Dataset.from_dict({"prompt": prompts, "ground_truth": truths})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="local model directory (saved with save_pretrained), the one the vLLM server serves")
    parser.add_argument("--vllm-url", default="http://localhost:8000", help="base URL of the vLLM server")
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps; -1 trains num_train_epochs")
    parser.add_argument("--output-dir", default="outputs/custom_rewards")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=1024)
    parser.add_argument("--rewards", default=",".join(REWARDS), help=f"comma-separated subset of {list(REWARDS)}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> AsyncGRPOTrainer:
    """Train with the four reward functions; returns the trainer (its ``state.log_history`` holds the metrics)."""
    args = parse_args(argv)
    unknown = set(args.rewards.split(",")) - set(REWARDS)
    if unknown:
        raise SystemExit(f"unknown rewards {sorted(unknown)}; choose among {list(REWARDS)}")
    config = AsyncGRPOConfig(
        output_dir=args.output_dir, vllm_server_base_url=args.vllm_url, max_steps=args.max_steps,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
    )
    trainer = AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=[REWARDS[name] for name in args.rewards.split(",")],
        args=config,
        train_dataset=build_dataset(),
    )
    trainer.train()
    return trainer


if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    main()
