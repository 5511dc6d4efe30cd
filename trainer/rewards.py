"""Ready-made reward functions.

A reward function takes keyword arguments ``prompts``, ``completions`` (conversational: lists of
message dicts), ``completion_ids`` and every other dataset column, and returns one float (or
``None``: "does not apply") per completion. It runs in the rollout worker, so it must be picklable
(a module-level function, a ``functools.partial`` or a callable instance).
"""

from __future__ import annotations

import logging
from typing import Any

from trainer.records import TOOL_ERROR_PREFIX

__all__ = ["TOOL_ERROR_PENALTY", "accuracy_reward", "tool_error_penalty"]

logger = logging.getLogger(__name__)

TOOL_ERROR_PENALTY = 0.5


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


def tool_error_penalty(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """``-TOOL_ERROR_PENALTY`` (-0.5) for a rollout with a failed tool call, else 0.0.

    A failed call is one whose tool message opens with the trainer's error prefix (``Error: ``): a
    malformed call, an unknown tool name, wrong arguments or a tool that raised. Used beside an
    environment's ``get_reward`` (rewards are summed), it stops failed calls from being free. The
    demo's counter policy showed why that matters: a rollout that reached its target and then
    emitted garbage calls (which change nothing, so the reward stays 1.0) was reinforced, garbage
    included, until the policy opened every turn with repeated ``<tool_call>`` tokens and its
    success fell from 0.6 to 0.2. With the penalty a clean success (1.0) beats a messy one (0.5),
    which beats a clean failure (0.0).

    Args:
        completions: Completions in conversational format (tool messages included).
        **kwargs: Other columns, ignored.

    Returns:
        One reward per completion.
    """
    def failed(message: dict[str, Any]) -> bool:
        return message.get("role") == "tool" and str(message.get("content", "")).startswith(TOOL_ERROR_PREFIX)

    return [-TOOL_ERROR_PENALTY if any(failed(m) for m in completion) else 0.0 for completion in completions]
