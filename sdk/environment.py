"""The environment contract: what a class must offer to be trained against and served.

Subclassing ``Environment`` is optional: any class with the same shape works (duck typing), as in
TRL's AsyncGRPOTrainer docs' ``IncrementEnv``. The base class exists to write the contract down once.
"""

from __future__ import annotations

from typing import Any

RESERVED_NAMES: frozenset[str] = frozenset({"reset", "get_reward", "close"})
"""Lifecycle hooks: never exposed as tools, whatever their docstring."""


class Environment:
    """Base class of a stateful tool-calling environment.

    One instance serves one rollout at a time and is reused across episodes: ``reset`` starts the
    next one. Every public method (a name not starting with ``_``) other than the reserved hooks is
    a tool. A tool may be sync or ``async``; it must type-hint every argument with a JSON-expressible
    type (``int``, ``float``, ``str``, ``bool``, ``list[...]``, ``dict[str, ...]``, ``Literal``,
    unions, ``None``) and carry a Google-style docstring whose ``Args:`` section describes every
    argument. The schema the model sees is exactly ``transformers.utils.get_json_schema(method)``.
    What a tool returns reaches the model as ``str(value)``; an exception it raises reaches the model
    as a tool error and the episode goes on.

    Optional hooks, looked up by name (so they are not declared here):

    * ``get_reward(self) -> float`` (sync or async): the environment scores the episode that just
      ran from its own state. Called once per finished rollout. A reward function can read the same
      state instead: one that declares ``environments`` gets each rollout's instance after its
      episode (TRL GRPOTrainer's signature), to score text and state together (``docs/interop.md``).
    * ``close(self) -> None``: release resources; the env server calls it when a session ends.

    Environments must be constructible with no arguments (``environment_factory`` is a zero-argument
    callable; use ``functools.partial`` to bind parameters) and picklable as a class.
    """

    def reset(self, **kwargs: Any) -> str | None:
        """Start a new episode.

        Args:
            **kwargs: The dataset row's columns when training on a dataset (e.g. ``target=3``);
                nothing when the environment samples its own task. Unknown columns must be ignored.

        Returns:
            The user prompt for the episode, or ``None`` when the dataset row supplies the prompt.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement reset(**kwargs)")
