"""Multi-task rewards: example 4 of TRL's "Using custom reward functions".

One dataset mixes math and coding problems; its ``task`` column says which is which. Each
task-specific reward function scores the rows of its own task and returns ``None`` for the others:
a ``None`` is left out of that completion's reward (the reward is the sum of the values that are not
``None``) and out of ``rewards/<name>/mean``, so ``rewards/math_reward_func/mean`` averages math
completions only. A completion that every function skips would be unscorable (advantage 0).

``brevity_reward`` applies to every task. It is a small dense term: while the policy solves
nothing, the task rewards are all -1.0 and every group would be dropped for equal rewards
(``frac_zero_std_groups``); this term still separates the completions of a group.

Code is graded with ``environments.sandbox.score_tests`` (the solution runs in a resource-limited
interpreter isolated by the operating system, the tests where it cannot reach them), and only when
it compiles. The training code sits under ``if __name__ == "__main__":`` because the
spawned rollout worker re-imports this file to unpickle the reward functions.

Start a vLLM server on the model, then run::

    toolgym vllm models/Qwen2.5-0.5B-Instruct --port 8000 --max-model-len 4096
    python examples/multi_task_rewards.py --model models/Qwen2.5-0.5B-Instruct --vllm-url http://localhost:8000 \\
        --max-steps 200 --output-dir outputs/multi_task_rewards
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from datasets import Dataset

from environments.sandbox import Limits, score_tests
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer

# Define a dataset that contains both math and coding problems. `answer` only applies to math rows
# and `tests` only to coding rows: the other task's rows hold None there.
PROBLEMS = [
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "task": "math", "answer": "4", "tests": None},
    {"prompt": [{"role": "user", "content": "Write a function add(a, b) that returns the sum of two numbers."}],
     "task": "code", "answer": None, "tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]},
    {"prompt": [{"role": "user", "content": "What is 3*4?"}], "task": "math", "answer": "12", "tests": None},
    {"prompt": [{"role": "user", "content": "Write a function mul(a, b) that returns the product of two numbers."}],
     "task": "code", "answer": None, "tests": ["assert mul(2, 3) == 6", "assert mul(-2, 4) == -8"]},
    {"prompt": [{"role": "user", "content": "What is 15-7?"}], "task": "math", "answer": "8", "tests": None},
    {"prompt": [{"role": "user", "content": "Write a function square(x) that returns x squared."}],
     "task": "code", "answer": None, "tests": ["assert square(3) == 9", "assert square(-4) == 16"]},
]

CODE_LIMITS = Limits(cpu_seconds=2, wall_seconds=5.0)


def _text(completion: list[dict[str, Any]]) -> str:
    """The completion's last assistant message."""
    return next((m.get("content") or "" for m in reversed(completion) if m.get("role") == "assistant"), "")


def check_math_solution(completion: list[dict[str, Any]], answer: str) -> bool:
    """Whether the last number in the completion equals the expected answer."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", _text(completion))
    return bool(numbers) and float(numbers[-1]) == float(answer)


def test_code_solution(completion: list[dict[str, Any]], tests: list[str]) -> bool:
    """Whether the completion's code (its last ```python block, else the whole text) passes the tests."""
    text = _text(completion)
    blocks = re.findall(r"```(?:python)?\n(.*?)```", text, flags=re.DOTALL)
    code = blocks[-1] if blocks else text
    try:
        compile(code, "<completion>", "exec")  # most wrong answers stop here, without a subprocess
    except (SyntaxError, ValueError):
        return False
    # Graded where the code cannot reach the tests (a solution that exits early or patches the
    # asserts scores 0): ``run_python(code + tests).ok`` would reward ``import os; os._exit(0)``.
    return score_tests(code, tests, CODE_LIMITS) == 1.0


# Math-specific reward function
def math_reward_func(
    prompts: list[Any], completions: list[list[dict[str, Any]]], task: list[str], answer: list[str | None],
    **kwargs: Any,
) -> list[float | None]:
    """1.0 for a correct math answer, -1.0 for a wrong one, None for the other tasks' rows."""
    rewards: list[float | None] = []
    for completion, t, expected in zip(completions, task, answer, strict=True):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(completion, str(expected))
            rewards.append(1.0 if correct else -1.0)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


# Coding-specific reward function
def coding_reward_func(
    prompts: list[Any], completions: list[list[dict[str, Any]]], task: list[str], tests: list[list[str] | None],
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the code passes the row's tests, -1.0 when not, None for the other tasks' rows."""
    rewards: list[float | None] = []
    for completion, t, row_tests in zip(completions, task, tests, strict=True):
        if t == "code":
            # Calculate coding-specific reward
            works = test_code_solution(completion, list(row_tests or []))
            rewards.append(1.0 if works else -1.0)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards


def brevity_reward(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """For every task: -0.1 x (characters of the answer / 1000), at most -0.1 (prefer short answers)."""
    return [-0.1 * min(len(_text(c)), 1000) / 1000 for c in completions]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="local model directory (saved with save_pretrained), the one the vLLM server serves")
    parser.add_argument("--vllm-url", default="http://localhost:8000", help="base URL of the vLLM server")
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps; -1 trains num_train_epochs")
    parser.add_argument("--output-dir", default="outputs/multi_task_rewards")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=512)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> AsyncGRPOTrainer:
    """Train on the mixed dataset with both task-specific rewards; returns the trainer."""
    args = parse_args(argv)
    config = AsyncGRPOConfig(
        output_dir=args.output_dir, vllm_server_base_url=args.vllm_url, max_steps=args.max_steps,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
    )
    # Use both task-specific reward functions, plus the dense one that applies to every task
    trainer = AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=[math_reward_func, coding_reward_func, brevity_reward],
        args=config,
        train_dataset=Dataset.from_list(PROBLEMS),
    )
    trainer.train()
    return trainer


if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    main()
