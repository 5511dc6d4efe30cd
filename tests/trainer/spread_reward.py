"""A reward for short trainer runs on the random tiny model: every group has spread, so every group trains.

A length reward does not do that here: the tiny model almost never samples EOS, so all of a group's
completions run to ``max_completion_length``, tie, and the group is dropped (measured: 95-99 % of
groups at 16 tokens). A run of a few steps then spends most of its time generating groups it throws
away. This reward reads the tokens instead, and two different completions almost surely differ.
"""

from __future__ import annotations

from typing import Any

VOCAB_SPREAD = 1009  # a prime: token ids spread over [0, 1) whatever the vocabulary size


def token_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """The mean of ``token_id % 1009 / 1009`` over the completion's tokens (0.0 when it is empty)."""
    return [sum(t % VOCAB_SPREAD for t in ids) / (VOCAB_SPREAD * len(ids)) if ids else 0.0
            for ids in completion_ids]
