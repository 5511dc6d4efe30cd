"""Environments: the ``IncrementEnv`` of TRL's AsyncGRPOTrainer docs, without a dataset and with one.

``environment_factory=IncrementEnv`` (``environments/counter.py``) makes one environment per
rollout in flight, reused across episodes. Its public method ``increment`` is the model's tool;
``reset`` starts an episode and ``get_reward`` scores it (logged as ``rewards/IncrementEnv/mean``).

* Without a dataset (the default) the environment owns the data: ``reset()`` samples a target and
  returns the prompt. There are no epochs, so ``max_steps`` is required.
* With ``--with-dataset`` every row's columns reach ``reset`` as keyword arguments: the ``target``
  column arrives as ``reset(target=...)``. The row's ``prompt`` (a system message here) comes first
  and the text ``reset`` returns is added as the user turn.

Rewards from the environment and from ``reward_funcs`` add up: ``brevity_reward`` scores the text
(a small dense term that separates the completions of a group while no rollout reaches its target;
a group whose rewards are all equal is dropped). ``--episode-log FILE`` runs
``RecordingIncrementEnv``, which appends one JSON line per episode to FILE: what ``reset`` received,
the target, the final counter and the reward (its reward is then logged under that class name).

Start a vLLM server on a tool-calling model, then run::

    toolgym vllm models/Qwen3-0.6B --port 8000 --max-model-len 4096
    python examples/increment_env.py --model models/Qwen3-0.6B --vllm-url http://localhost:8000 \\
        --max-steps 1000 --output-dir outputs/increment_env [--with-dataset] [--episode-log episodes.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import json
import threading
from collections.abc import Callable
from typing import Any

from datasets import Dataset

from environments.counter import IncrementEnv
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer

_LOG_LOCK = threading.Lock()  # reset/get_reward run on the worker's thread pool


class RecordingIncrementEnv(IncrementEnv):
    """``IncrementEnv`` that appends each finished episode to a JSON-lines file.

    Args:
        log_path: The file to append to.
    """

    def __init__(self, log_path: str) -> None:
        super().__init__()
        self._log_path = log_path
        self._reset_kwargs: dict[str, Any] = {}

    def reset(self, **kwargs: Any) -> str:
        """Start an episode (see ``IncrementEnv.reset``), remembering what it received."""
        self._reset_kwargs = dict(kwargs)
        return super().reset(**kwargs)

    def get_reward(self) -> float:
        """``IncrementEnv.get_reward``, after logging the episode."""
        reward = super().get_reward()
        record = {"reset_kwargs": self._reset_kwargs, "target": self.target, "counter": self.counter, "reward": reward}
        with _LOG_LOCK, open(self._log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        return reward


def brevity_reward(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """-0.1 x (characters of the final answer / 1000), at most -0.1: act with the tool, say little."""
    finals = [next((m.get("content") or "" for m in reversed(c) if m.get("role") == "assistant"), "")
              for c in completions]
    return [-0.1 * min(len(text), 1000) / 1000 for text in finals]


def build_dataset() -> Dataset:
    """Each row carries a prompt and the task data (here, the counter target to reach)."""
    system = {"role": "system", "content": "You control a counter through the increment tool. Reach the "
                                           "target, then stop."}
    targets = list(range(1, 7))
    return Dataset.from_dict({"prompt": [[system] for _ in targets], "target": targets})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="local model directory (saved with save_pretrained), the one the vLLM server serves")
    parser.add_argument("--vllm-url", default="http://localhost:8000", help="base URL of the vLLM server")
    parser.add_argument("--max-steps", type=int, default=1000, help="optimizer steps (required without a dataset)")
    parser.add_argument("--output-dir", default="outputs/increment_env")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256, help="tokens per turn")
    parser.add_argument("--with-dataset", action="store_true", help="targets from a dataset's `target` column")
    parser.add_argument("--episode-log", default=None, help="append one JSON line per episode to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> AsyncGRPOTrainer:
    """Train on the counter environment; returns the trainer."""
    args = parse_args(argv)
    config = AsyncGRPOConfig(
        output_dir=args.output_dir, vllm_server_base_url=args.vllm_url, max_steps=args.max_steps,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=8, chat_template_kwargs={"enable_thinking": False},
    )
    factory: Callable[[], IncrementEnv] = IncrementEnv
    if args.episode_log:  # a partial of a module-level class pickles into the rollout worker
        factory = functools.partial(RecordingIncrementEnv, log_path=args.episode_log)
    trainer = AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=brevity_reward,  # trainer-owned: scores the completion text
        args=config,
        train_dataset=build_dataset() if args.with_dataset else None,  # None: the environment owns the data
        environment_factory=factory,  # env-owned: scores its internal state via `get_reward`
    )
    trainer.train()
    return trainer


if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    main()
