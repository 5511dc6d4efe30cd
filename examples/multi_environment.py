"""Several environments in one run, routed by the dataset's ``environment`` column.

``environment_factory={"coding": CodingEnv, "game": GameEnv}`` (TRL's "Multiple
environments"): each rollout takes the environment its row names, and only that environment's
tools are shown to the model (``run_code`` for coding rows, ``move`` for game rows), so no rollout
sees tools that do not belong to its task. Each environment owns its data and returns the prompt
from ``reset()``; the ``environment`` column is the trainer's and is not passed to ``reset``. The
other columns are: here ``seed``, from which ``reset`` derives the task, so the rollouts of a group
start from the same state and share one baseline. Instances are reused across episodes.

Rewards: each environment scores its episode with ``get_reward`` (logged as
``rewards/CodingEnv/mean`` and ``rewards/GameEnv/mean``), and ``brevity_reward`` scores the text of
every rollout (a small dense term that separates the completions of a group while no rollout
succeeds; a group whose rewards are all equal is dropped). ``--episode-log FILE`` makes the
environments append one JSON line per finished episode to FILE.

Start a vLLM server on a tool-calling model, then run::

    toolgym vllm models/Qwen3-0.6B --port 8000 --max-model-len 4096
    python examples/multi_environment.py --model models/Qwen3-0.6B --vllm-url http://localhost:8000 \\
        --max-steps 500 --output-dir outputs/multi_environment [--episode-log episodes.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import threading
from typing import Any

from datasets import Dataset

from environments.sandbox import Limits, run_python
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer

_LOG_LOCK = threading.Lock()  # reset/get_reward/tools run on the worker's thread pool
CODE_LIMITS = Limits(cpu_seconds=2, wall_seconds=5.0)


def _append(log_path: str | None, record: dict[str, Any]) -> None:
    if log_path:
        with _LOG_LOCK, open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def fibonacci(n: int) -> int:
    """The n-th Fibonacci number, with fibonacci(1) == fibonacci(2) == 1."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class CodingEnv:
    """Compute a Fibonacci number by running Python; reward 1.0 once a ``run_code`` call printed it
    and nothing else.

    Args:
        log_path: Append one JSON line per finished episode here (``None``: no log).
    """

    def __init__(self, log_path: str | None = None) -> None:
        self._log_path = log_path
        self._reset_kwargs: dict[str, Any] = {}
        self.n = 0
        self.solved = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Start an episode: the task comes from ``seed`` (the same for every rollout of a row)."""
        self._reset_kwargs = {"seed": seed, **kwargs}
        self.n = random.Random(seed).randint(1, 20)
        self.solved = False
        return f"Compute the {self.n}th Fibonacci number. Print it with the run_code tool."

    def get_reward(self) -> float:
        """1.0 when a ``run_code`` call printed exactly the answer, else 0.0."""
        reward = float(self.solved)
        _append(self._log_path, {"env": type(self).__name__, "reset_kwargs": self._reset_kwargs, "n": self.n,
                                 "reward": reward})
        return reward

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        result = run_python(code, CODE_LIMITS)
        # The whole output must be the answer: accepting it anywhere in the output would reward a
        # program that prints every Fibonacci number up to F(20).
        if result.ok and result.output.strip() == str(fibonacci(self.n)):
            self.solved = True
        return result.output


class GameEnv:
    """Walk on a 4x4 grid to the goal tile; reward 1.0 on reaching it.

    Args:
        log_path: Append one JSON line per finished episode here (``None``: no log).
    """

    SIZE = 4
    MOVES = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}

    def __init__(self, log_path: str | None = None) -> None:
        self._log_path = log_path
        self._reset_kwargs: dict[str, Any] = {}
        self.position = self.goal = (0, 0)

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Start an episode: start and goal come from ``seed`` (the same for every rollout of a row)."""
        self._reset_kwargs = {"seed": seed, **kwargs}
        cells = [(x, y) for x in range(self.SIZE) for y in range(self.SIZE)]
        self.position, self.goal = random.Random(seed).sample(cells, 2)
        return f"Reach the goal tile. {self._observation()}"

    def get_reward(self) -> float:
        """1.0 when standing on the goal, else 0.0."""
        reward = float(self.position == self.goal)
        _append(self._log_path, {"env": type(self).__name__, "reset_kwargs": self._reset_kwargs, "reward": reward})
        return reward

    def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        if action not in self.MOVES:
            raise ValueError(f"unknown action {action!r}; use one of {sorted(self.MOVES)}")
        dx, dy = self.MOVES[action]
        x, y = self.position
        self.position = (min(max(x + dx, 0), self.SIZE - 1), min(max(y + dy, 0), self.SIZE - 1))
        return self._observation()

    def _observation(self) -> str:
        return f"You are at {self.position}, the goal is at {self.goal} (x grows rightwards, y downwards)."


def brevity_reward(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """-0.1 x (characters of the final answer / 1000), at most -0.1: act with the tools, say little."""
    finals = [next((m.get("content") or "" for m in reversed(c) if m.get("role") == "assistant"), "")
              for c in completions]
    return [-0.1 * min(len(text), 1000) / 1000 for text in finals]


def build_dataset(size: int = 1000) -> Dataset:
    """The dataset only routes (``environment``) and seeds each row's task (``seed``)."""
    return Dataset.from_dict({"environment": ["coding", "game"] * (size // 2), "seed": list(range(size // 2 * 2))})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="local model directory (saved with save_pretrained), the one the vLLM server serves")
    parser.add_argument("--vllm-url", default="http://localhost:8000", help="base URL of the vLLM server")
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps; -1 trains num_train_epochs")
    parser.add_argument("--output-dir", default="outputs/multi_environment")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256, help="tokens per turn")
    parser.add_argument("--episode-log", default=None, help="append one JSON line per episode to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> AsyncGRPOTrainer:
    """Train on the coding/game mixture; returns the trainer."""
    args = parse_args(argv)
    config = AsyncGRPOConfig(
        output_dir=args.output_dir, vllm_server_base_url=args.vllm_url, max_steps=args.max_steps,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=8, chat_template_kwargs={"enable_thinking": False},
    )
    # Module-level classes (or partials of them) pickle into the rollout worker.
    factories = {"coding": functools.partial(CodingEnv, log_path=args.episode_log),
                 "game": functools.partial(GameEnv, log_path=args.episode_log)}
    trainer = AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=brevity_reward,
        args=config,
        train_dataset=build_dataset(),
        environment_factory=factories,
    )
    trainer.train()
    return trainer


if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    main()
