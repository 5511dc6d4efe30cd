"""Train on an OpenEnv environment: the counting environment of ``openenv_counting.py``, served by OpenEnv.

``environment_factory`` makes ``sdk.OpenEnvEnvironment``s bound to the OpenEnv server's URL (a
``functools.partial`` pickles into the rollout worker): each is one OpenEnv WebSocket session,
reused across episodes. The row's ``target`` column reaches OpenEnv's ``reset(target=...)``; the
environment's ``increment`` tool (an MCP tool of the OpenEnv environment) is the model's; the reward
of the last observation is the environment's reward (``rewards/OpenEnvEnvironment/mean``). Two reward
functions add to it: ``tool_steps`` declares ``environments`` and reads each rollout's OpenEnv state
(its step count) after the episode, and ``brevity_reward`` scores the text.

Start the OpenEnv server (with the OpenEnv venv: ``docs/interop.md``) and a vLLM server, then run::

    .cache/openenv/venv/bin/python examples/openenv_counting.py --port 8770 &
    toolgym tiny-model .cache/tiny-model
    toolgym vllm .cache/tiny-model --port 8000 --max-model-len 1024 &
    python examples/openenv_training.py --model .cache/tiny-model --vllm-url http://localhost:8000 \\
        --openenv-url http://127.0.0.1:8770 --max-steps 2 --num-generations 4 --max-completion-length 16
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from datasets import Dataset

from sdk import OpenEnvEnvironment
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer


def tool_steps(completions: list[list[dict[str, Any]]], environments: list[Any], **kwargs: Any) -> list[float]:
    """-0.01 per step the OpenEnv session counted: reach the target in few calls.

    A sync function runs in a thread: each remote environment's ``state()`` blocks here while its
    coroutine runs on the rollout worker's loop.
    """
    return [-0.01 * env.state()["step_count"] for env in environments]


def brevity_reward(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """-0.1 x (characters of the final answer / 1000), at most -0.1: act with the tool, say little."""
    finals = [next((m.get("content") or "" for m in reversed(c) if m.get("role") == "assistant"), "")
              for c in completions]
    return [-0.1 * min(len(text), 1000) / 1000 for text in finals]


def build_dataset() -> Dataset:
    """A system prompt and a target per row; the environment's reset turns the target into the task."""
    system = {"role": "system", "content": "You control a counter through the increment tool. Reach the "
                                           "target, then stop."}
    targets = list(range(1, 7))
    return Dataset.from_dict({"prompt": [[system] for _ in targets], "target": targets})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="local model directory (saved with save_pretrained), the one the vLLM server serves")
    parser.add_argument("--vllm-url", default="http://localhost:8000", help="base URL of the vLLM server")
    parser.add_argument("--openenv-url", default="http://127.0.0.1:8770", help="base URL of the OpenEnv server")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--output-dir", default="outputs/openenv_training")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256, help="tokens per turn")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> AsyncGRPOTrainer:
    """Train against the OpenEnv server; returns the trainer."""
    args = parse_args(argv)
    config = AsyncGRPOConfig(
        output_dir=args.output_dir, vllm_server_base_url=args.vllm_url, max_steps=args.max_steps,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=8, chat_template_kwargs={"enable_thinking": False},
    )
    trainer = AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=[tool_steps, brevity_reward],
        args=config,
        train_dataset=build_dataset(),
        environment_factory=functools.partial(OpenEnvEnvironment, args.openenv_url),
    )
    trainer.train()
    return trainer


if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    main()
