"""The Gymnasium bridge, both ways.

* ``ToolEnv``: any toolgym environment (local or remote) as a ``gymnasium.Env``. Observations are
  text (the prompt, then each tool result); an action is a tool call as JSON text,
  ``{"name": "increment", "arguments": {"step": 1}}``, and any other text is the final answer,
  which ends the episode with ``get_reward()`` as its reward. ``register_environment`` registers
  one as ``toolgym/<Name>-v0``. The bundled environments register themselves when ``environments``
  is imported, so ``gymnasium.make("toolgym/IncrementEnv-v0")`` works after ``import environments``,
  and ``gymnasium.make("environments:toolgym/IncrementEnv-v0")`` works without it.
* ``GymnasiumEnvironment``: a Gymnasium env with text-describable observations as a toolgym
  environment with one ``step(action)`` tool; the episode's return is its reward.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import re
import string
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, cast

import gymnasium
from gymnasium import spaces

from sdk.environment import Environment
from sdk.loading import load_target
from sdk.tools import environment_tools

MAX_TEXT = 1 << 16
_CHARSET = string.printable
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ToolEnv(gymnasium.Env[str, str]):
    """A toolgym environment seen as a ``gymnasium.Env`` with text observations and actions.

    Args:
        env_factory: Zero-argument callable making the environment, or its ``module:Class`` spec.
        max_steps: Tool calls after which the episode is truncated (and scored).
        reset_kwargs: Keyword arguments for every ``reset`` (a fixed dataset row); ``options``
            given to ``reset`` are merged over them.
    """

    metadata = {"render_modes": []}

    def __init__(self, env_factory: Callable[[], object] | str, max_steps: int = 32,
                 reset_kwargs: Mapping[str, Any] | None = None) -> None:
        factory = load_target(env_factory) if isinstance(env_factory, str) else env_factory
        self.env = factory()
        self.max_steps = max_steps
        self.reset_kwargs = dict(reset_kwargs or {})
        self.observation_space = spaces.Text(MAX_TEXT, min_length=0, charset=_CHARSET)
        self.action_space = spaces.Text(MAX_TEXT, min_length=0, charset=_CHARSET)
        self._runner = asyncio.Runner()
        self._tools = {tool.name: tool for tool in environment_tools(self.env)}
        self._steps = 0
        self._takes_seed = _accepts_keyword(self.env.reset, "seed")  # type: ignore[attr-defined]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode: ``env.reset(**reset_kwargs, **options, seed=seed)``.

        The environment reseeds its own random choices from ``seed`` (the bundled ones do), so the
        same seed gives the same episode, as Gymnasium's ``check_env`` requires.

        Returns:
            The prompt (``""`` when the environment returns ``None``) and ``{"tools": schemas}``
            (a fresh copy on every call).

        Raises:
            TypeError: a seed was given and the environment's ``reset`` cannot take one.
        """
        super().reset(seed=seed)
        kwargs = {**self.reset_kwargs, **(options or {})}
        if seed is not None:
            if not self._takes_seed:
                raise TypeError(f"{type(self.env).__name__}.reset takes no 'seed' argument, so reset(seed=...) "
                                "cannot be deterministic: add 'seed: int | None = None' to it and reseed the "
                                "environment's random choices from it")
            kwargs["seed"] = seed
        self._steps = 0
        prompt = self._await(self.env.reset(**kwargs))  # type: ignore[attr-defined]
        return prompt or "", {"tools": [copy.deepcopy(tool.schema) for tool in self._tools.values()]}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run one tool call, or end the episode on a final answer.

        Args:
            action: ``{"name": ..., "arguments": {...}}`` as JSON text; anything else is the answer.

        Returns:
            ``(observation, reward, terminated, truncated, info)``: the tool's result (or
            ``"Error: ..."``), 0 until the episode ends and then ``get_reward()``, and
            ``info = {"tool": name, "error": bool}`` for a tool call.
        """
        call = _parse_call(action)
        if call is None:
            return "", self._reward(), True, False, {"answer": action}
        name, arguments = call
        self._steps += 1
        try:
            tool = self._tools[name]
            observation, failed = str(self._await(tool.func(**arguments))), False
        except KeyError:
            observation, failed = f"Error: unknown tool {name!r}; available: {', '.join(self._tools)}", True
        except Exception as exc:
            observation, failed = f"Error: {exc}", True
        truncated = self._steps >= self.max_steps
        reward = self._reward() if truncated else 0.0
        return observation, reward, False, truncated, {"tool": name, "error": failed}

    def close(self) -> None:
        """Close the environment (``close`` or ``aclose`` when it has one) and the private loop."""
        for hook in ("close", "aclose"):
            method = getattr(self.env, hook, None)
            if callable(method):
                self._await(method())
                break
        self._runner.close()

    def _reward(self) -> float:
        get_reward = getattr(self.env, "get_reward", None)
        value = self._await(get_reward()) if callable(get_reward) else None
        return float(value) if value is not None else 0.0

    def _await(self, value: Any) -> Any:
        return self._runner.run(cast("Coroutine[Any, Any, Any]", value)) if inspect.isawaitable(value) else value


def _accepts_keyword(func: Callable[..., Any], name: str) -> bool:
    """Whether ``func`` takes the keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call decide
        return True
    return any((p.name == name and p.kind is not p.POSITIONAL_ONLY) or p.kind is p.VAR_KEYWORD for p in parameters)


def _parse_call(action: str) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` when ``action`` is a JSON tool call, else ``None`` (a final answer)."""
    try:
        call = json.loads(action)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return call["name"], arguments if isinstance(arguments, dict) else {}


def register_environment(env_factory: Callable[[], object] | str, name: str | None = None,
                         max_steps: int = 32, **reset_kwargs: Any) -> str:
    """Register a toolgym environment with Gymnasium as ``toolgym/<name>-v0``.

    Args:
        env_factory: The environment class / zero-argument factory, or its ``module:Class`` spec.
        name: The registered name; defaults to the class name.
        max_steps: Tool calls per episode before truncation.
        **reset_kwargs: Fixed keyword arguments for ``reset``.

    Returns:
        The id to pass to ``gymnasium.make``.
    """
    if name is None:
        name = env_factory.rpartition(":")[2] if isinstance(env_factory, str) else env_factory.__name__
    env_id = f"toolgym/{name}-v0"
    # gymnasium's EnvCreator protocol wants a ``**kwargs``-only callable; make() calls ToolEnv(**kwargs).
    gymnasium.register(env_id, entry_point=ToolEnv, disable_env_checker=True,  # type: ignore[arg-type]
                       kwargs={"env_factory": env_factory, "max_steps": max_steps, "reset_kwargs": reset_kwargs})
    return env_id


class GymnasiumEnvironment(Environment):
    """A Gymnasium env as a toolgym environment: one ``step(action)`` tool, reward = episode return.

    Subclasses set the class attributes (or pass them to ``__init__``) and may override
    ``_observation_text`` to describe observations better than the default (the env's ``ansi``
    rendering without colour codes, else ``str(observation)``).

    Attributes:
        env_id: The Gymnasium id to ``make``.
        make_kwargs: Keyword arguments for ``gymnasium.make``.
        action_names: Names of a ``Discrete`` action space's actions, in order.
        task: One sentence telling the model what to achieve.
    """

    env_id: str = ""
    make_kwargs: Mapping[str, Any] = {}
    action_names: Sequence[str] = ()
    task: str = "Play the game to maximise your reward."

    def __init__(self, env_id: str | None = None, action_names: Sequence[str] | None = None,
                 **make_kwargs: Any) -> None:
        self.env_id = env_id or self.env_id
        self.action_names = tuple(action_names or self.action_names)
        self.env = gymnasium.make(self.env_id, **{**self.make_kwargs, **make_kwargs})
        self.total_reward = 0.0
        self.done = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Start an episode; returns a prompt with the task, the actions and the first observation.

        Args:
            seed: Seed for the Gymnasium env's reset.
            **kwargs: Other dataset columns, ignored.
        """
        observation, _ = self.env.reset(seed=seed)
        self.total_reward, self.done = 0.0, False
        actions = ", ".join(self.action_names) if self.action_names else str(self.env.action_space)
        return (f"{self.task}\nCall the step tool with one action at a time. Actions: {actions}.\n"
                f"Current state:\n{self._observation_text(observation)}")

    def step(self, action: str) -> str:
        """Take one action in the game.

        Args:
            action: The action's name, as listed in the prompt (or its number).

        Returns:
            The new state, the reward the action earned, and whether the game is over.
        """
        if self.done:
            raise RuntimeError("the game is over; no more actions are accepted")
        observation, reward, terminated, truncated, _ = self.env.step(self._parse_action(action))
        self.total_reward += float(reward)
        self.done = bool(terminated or truncated)
        status = "Game over." if self.done else "Game continues."
        return f"{self._observation_text(observation)}\nReward: {float(reward):g}. {status}"

    def get_reward(self) -> float:
        """The episode's return: the sum of the Gymnasium rewards so far."""
        return self.total_reward

    def close(self) -> None:
        """Close the Gymnasium env."""
        self.env.close()

    def _parse_action(self, action: str) -> Any:
        space = self.env.action_space
        if isinstance(space, spaces.Discrete):
            names = [n.lower() for n in self.action_names]
            text = action.strip().lower()
            if text in names:
                return space.start + names.index(text)
            if text.lstrip("-").isdigit() and space.contains(int(text)):
                return int(text)
            raise ValueError(f"invalid action {action!r}; choose one of: {', '.join(self.action_names) or space}")
        if isinstance(space, spaces.Text):
            return action
        value = json.loads(action)
        if not space.contains(value):
            raise ValueError(f"action {action!r} is not in the action space {space}")
        return value

    def _observation_text(self, observation: Any) -> str:
        if self.env.render_mode == "ansi":
            return _ANSI.sub("", str(self.env.render())).strip("\n")
        return str(observation)

