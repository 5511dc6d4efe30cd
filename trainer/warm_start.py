"""Warm start: a short supervised fine-tune of the tiny model on synthetic transcripts.

A randomly initialised model never emits a well-formed tool call, so an RL run starting from it has
no signal. The warm start teaches the format, not the skill: transcripts come from a deliberately
imperfect policy, so the warm model calls tools correctly but reaches the goal only part of the
time, and RL has something to learn. Two tasks:

- ``counter``: :class:`environments.counter.IncrementEnv` with its real tool schema. The prompt is
  what ``reset(target=t)`` returns; each assistant turn calls ``increment`` once, with the remaining
  distance with probability ``exact_step_prob`` and otherwise a step drawn from ``counter_steps``,
  until the counter reaches or passes the target; the tool replies carry the counter; a final
  assistant message states the counter. With the defaults about 47 % of transcripts succeed.
- ``arithmetic``: ``What is a + b?`` answered ``The answer is \\boxed{s}.``, with a wrong sum in a
  fraction ``arithmetic_error_rate`` of transcripts.

Command line (through the tiny-model kit)::

    toolgym tiny-model OUT --warm-start {counter,arithmetic,all} [--seed N]
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from environments.counter import IncrementEnv

__all__ = [
    "TASKS",
    "Transcript",
    "WarmStartConfig",
    "arithmetic_prompt",
    "counter_tools",
    "synthetic_transcripts",
]

TASKS = ("counter", "arithmetic")


@dataclass(frozen=True)
class WarmStartConfig:
    """How the transcripts are drawn and how long the fine-tune runs.

    Attributes:
        task: ``"counter"``, ``"arithmetic"`` or ``"all"`` (both, interleaved).
        seed: Seeds the transcripts, the data order and the initialisation of training.
        num_transcripts: Transcripts per task.
        max_steps: Optimizer steps of the fine-tune.
        batch_size: Transcripts per optimizer step.
        learning_rate: Peak AdamW learning rate (linear warm-up over 5 % of steps, then cosine).
        max_target: Counter targets are drawn from ``[1, max_target]`` (``IncrementEnv``'s default range).
        counter_steps: Steps the imperfect counter policy draws from, uniformly.
        exact_step_prob: Probability that a counter turn steps exactly to the target instead.
        arithmetic_max: Arithmetic operands are drawn from ``[0, arithmetic_max]``.
        arithmetic_error_rate: Fraction of arithmetic transcripts whose boxed answer is wrong.
    """

    task: str = "all"
    seed: int = 0
    num_transcripts: int = 2000
    max_steps: int = 300
    batch_size: int = 16
    learning_rate: float = 3e-3
    max_target: int = 6
    counter_steps: tuple[int, ...] = (1, 2, 3, 4)
    exact_step_prob: float = 0.1
    arithmetic_max: int = 9
    arithmetic_error_rate: float = 0.5

    def __post_init__(self) -> None:
        if self.task not in (*TASKS, "all"):
            raise ValueError(f"task must be one of {(*TASKS, 'all')}, got {self.task!r}")
        if min(self.num_transcripts, self.max_steps, self.batch_size, self.max_target) < 1:
            raise ValueError(
                "num_transcripts, max_steps, batch_size and max_target must be >= 1, got "
                f"{self.num_transcripts}, {self.max_steps}, {self.batch_size}, {self.max_target}"
            )
        if not self.counter_steps or min(self.counter_steps) < 1:
            raise ValueError(f"counter_steps must be positive integers, got {self.counter_steps}")
        for name in ("exact_step_prob", "arithmetic_error_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this configuration trains on."""
        return TASKS if self.task == "all" else (self.task,)


@dataclass
class Transcript:
    """One synthetic conversation and the tool schemas rendered with it.

    Attributes:
        messages: The chat messages, first user prompt included.
        tools: Tool JSON schemas, or ``None`` for a task without tools.
        success: Whether the transcript reaches the task's goal.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    success: bool


def counter_tools() -> list[dict[str, Any]]:
    """The counter environment's tool schemas, exactly as the trainer renders them."""
    return [get_json_schema(IncrementEnv().increment)]


def arithmetic_prompt(a: int, b: int) -> str:
    """The user prompt of the arithmetic task for ``a + b`` (answer expected in ``\\boxed{}``)."""
    return f"What is {a} + {b}?"


def _tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def counter_transcript(target: int, rng: random.Random, config: WarmStartConfig) -> Transcript:
    """An episode of the imperfect counter policy against the real environment.

    Args:
        target: The counter target passed to ``reset``.
        rng: Draws the steps.
        config: The policy's step set and exact-step probability.
    """
    env = IncrementEnv()
    messages: list[dict[str, Any]] = [{"role": "user", "content": env.reset(target=target)}]
    while env.counter < env.target:
        remaining = env.target - env.counter
        step = remaining if rng.random() < config.exact_step_prob else rng.choice(config.counter_steps)
        messages.append({"role": "assistant", "content": "", "tool_calls": [_tool_call("increment", {"step": step})]})
        messages.append({"role": "tool", "content": str(env.increment(step))})
    messages.append({"role": "assistant", "content": f"The counter is now {env.counter}."})
    return Transcript(messages, counter_tools(), success=env.get_reward() == 1.0)


def arithmetic_transcript(rng: random.Random, config: WarmStartConfig) -> Transcript:
    """One addition question, answered correctly unless the error draw says otherwise."""
    a, b = rng.randint(0, config.arithmetic_max), rng.randint(0, config.arithmetic_max)
    answer = a + b
    if rng.random() < config.arithmetic_error_rate:
        answer = max(0, answer + rng.choice((-2, -1, 1, 2)))
    messages = [
        {"role": "user", "content": arithmetic_prompt(a, b)},
        {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."},
    ]
    return Transcript(messages, None, success=answer == a + b)


def synthetic_transcripts(config: WarmStartConfig) -> list[Transcript]:
    """``config.num_transcripts`` transcripts per task, interleaved, deterministic in ``config.seed``."""
    rng = random.Random(config.seed)
    per_task: list[list[Transcript]] = []
    for task in config.tasks:
        if task == "counter":
            per_task.append(
                [counter_transcript(rng.randint(1, config.max_target), rng, config) for _ in range(config.num_transcripts)]
            )
        else:
            per_task.append([arithmetic_transcript(rng, config) for _ in range(config.num_transcripts)])
    return [t for group in zip(*per_task) for t in group]
