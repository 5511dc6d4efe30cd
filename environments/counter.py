"""The counter environment of TRL's AsyncGRPOTrainer docs: reach a target by calling ``increment``.

With a dataset, the row's ``target`` column arrives in ``reset(target=...)``; without one the
environment samples its own target and returns the prompt.
"""

from __future__ import annotations

import random


class IncrementEnv:
    """A counter that starts at 0; the episode succeeds when it equals the target."""

    def __init__(self, max_target: int = 6, seed: int | None = None) -> None:
        self.max_target = max_target
        self._rng = random.Random(seed)
        self.counter = 0
        self.target = 0

    def reset(self, target: int | None = None, seed: int | None = None, **kwargs: object) -> str:
        """Start an episode; returns the user prompt.

        Args:
            target: The value to reach; sampled in ``[1, max_target]`` when not given.
            seed: Reseeds the sampling first: the same seed gives the same episode.
            **kwargs: Other dataset columns, ignored.
        """
        if seed is not None:
            self._rng.seed(seed)
        self.counter = 0
        self.target = int(target) if target is not None else self._rng.randint(1, self.max_target)
        return f"Increment the counter to {self.target}."

    def get_reward(self) -> float:
        """1.0 when the counter equals the target, else 0.0."""
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
