"""Ready-made reward functions.

A reward function takes keyword arguments ``prompts``, ``completions`` (conversational: lists of
message dicts), ``completion_ids`` and every other dataset column, and returns one float (or
``None``: "does not apply") per completion. It runs in the rollout worker, so it must be picklable
(a module-level function, a ``functools.partial`` or a callable instance).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["accuracy_reward"]

logger = logging.getLogger(__name__)


def _last_text(completion: list[dict[str, Any]] | str) -> str:
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant" and message.get("content"):
            return str(message["content"])
    return ""


def accuracy_reward(completions: list[list[dict[str, Any]]], solution: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer equals the gold ``solution`` column, else 0.0.

    Both sides are parsed with ``math-verify`` (LaTeX, ``\\boxed{}``, plain expressions) and compared
    symbolically. A gold answer that does not parse gives ``None`` (unscorable), not 0.0, so a bad
    dataset row does not teach the model that its answer was wrong.

    Args:
        completions: Completions in conversational format; the last assistant message is graded.
        solution: The gold answer of each completion's prompt (the dataset column ``solution``).
        **kwargs: Other columns, ignored.

    Returns:
        One reward per completion.
    """
    from math_verify import parse, verify

    rewards: list[float | None] = []
    for completion, gold in zip(completions, solution, strict=True):
        # Timeouts are signal-based and only work on the main thread; reward functions run on
        # worker threads, so parsing runs without them (inputs here are short).
        gold_parsed = parse(str(gold), parsing_timeout=None)  # type: ignore[arg-type]
        if not gold_parsed:
            logger.warning("accuracy_reward: the gold answer %r does not parse; the completion is not scored", gold)
            rewards.append(None)
            continue
        answer = parse(_last_text(completion), parsing_timeout=None)  # type: ignore[arg-type]
        rewards.append(float(verify(gold_parsed, answer, timeout_seconds=None)))
    return rewards
