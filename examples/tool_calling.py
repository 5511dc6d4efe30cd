"""Tools: the model calls plain Python functions while it generates (TRL's "Tools" section).

``tools=[multiply, async_add]`` gives the model one sync and one async tool. Each is a
module-level function with type hints and a Google-style docstring: the model sees the JSON schema
built from them and calls the tool by its ``__name__``; being module-level also lets it pickle into
the spawned rollout worker. Sync tools run on a thread pool of ``max_concurrent_rollouts`` threads,
async ones on the worker's event loop; the calls of one turn run in the order the model emitted them.
A failing tool or an unknown name becomes an error message for the model (``tools/failure_frequency``,
``tools/unknown_name_count``), never a crash. ``max_tool_calling_iterations`` caps the tool turns
(``tools/loop_exhausted_frac``).

Rewards: ``accuracy_reward`` (math-verify against the ``solution`` column) and ``brevity_reward``, a
small dense term that separates the completions of a group while the policy solves nothing (a group
whose rewards are all equal is dropped, see ``frac_zero_std_groups``).

Start a vLLM server on a tool-calling model, then run::

    toolgym vllm models/Qwen3-0.6B --port 8000 --max-model-len 4096
    python examples/tool_calling.py --model models/Qwen3-0.6B --vllm-url http://localhost:8000 \\
        --max-steps 200 --output-dir outputs/tool_calling
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from datasets import Dataset

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.rewards import accuracy_reward


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    await asyncio.sleep(0.001)  # stands for an I/O-bound call (a web API, a database)
    return a + b


def brevity_reward(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """-0.1 x (characters of the final answer / 1000), at most -0.1: prefer short final answers."""
    finals = [next((m.get("content") or "" for m in reversed(c) if m.get("role") == "assistant"), "")
              for c in completions]
    return [-0.1 * min(len(text), 1000) / 1000 for text in finals]


def build_dataset(size: int = 64, seed: int = 0) -> Dataset:
    """``(a + b) * c`` problems; the ``solution`` column is what ``accuracy_reward`` grades against."""
    rng = random.Random(seed)
    prompts, solutions = [], []
    for _ in range(size):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 19)
        prompts.append([{"role": "user", "content": f"What is ({a} + {b}) * {c}? Use the tools, then give the "
                                                      "final answer in \\boxed{}."}])
        solutions.append(str((a + b) * c))
    return Dataset.from_dict({"prompt": prompts, "solution": solutions})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="local model directory (saved with save_pretrained), the one the vLLM server serves")
    parser.add_argument("--vllm-url", default="http://localhost:8000", help="base URL of the vLLM server")
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps; -1 trains num_train_epochs")
    parser.add_argument("--output-dir", default="outputs/tool_calling")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=512, help="tokens per turn")
    parser.add_argument("--max-tool-calling-iterations", type=int, default=4)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> AsyncGRPOTrainer:
    """Train a tool-calling policy on ``(a + b) * c``; returns the trainer."""
    args = parse_args(argv)
    config = AsyncGRPOConfig(
        output_dir=args.output_dir, vllm_server_base_url=args.vllm_url, max_steps=args.max_steps,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
    )
    trainer = AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=[accuracy_reward, brevity_reward],
        args=config,
        train_dataset=build_dataset(),
        tools=[multiply, async_add],
    )
    trainer.train()
    return trainer


if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    main()
