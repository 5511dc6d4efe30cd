"""``check_env``: verify that an environment follows the contract, Gymnasium ``check_env`` style.

Errors (the trainer or the server would fail) raise ``EnvironmentCheckError``; doubts (legal but
probably unintended, such as an environment without tools) are ``UserWarning``s.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import pickle
import re
import warnings
from collections.abc import Coroutine, Mapping
from typing import Any, cast

from sdk.exceptions import EnvironmentCheckError, ToolDefinitionError
from sdk.tools import environment_tools

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI-style function calling accepts


def check_env(env_or_cls: object, reset_kwargs: Mapping[str, Any] | None = None, episodes: int = 2) -> None:
    """Check an environment class (instantiated with no arguments) or instance.

    Checks: the class pickles and constructs with no arguments; ``reset`` accepts ``**kwargs`` and
    returns ``str`` or ``None``; every tool has a valid name and a schema (type hints + docstring);
    ``get_reward``, when present, takes no arguments and returns a finite float; the instance is
    reusable for ``episodes`` episodes; ``close``, when present, runs. Async hooks are awaited.

    Args:
        env_or_cls: The environment class or instance.
        reset_kwargs: Keyword arguments for ``reset`` (a dataset row), if the environment needs one.
        episodes: How many episodes to run on the one instance.

    Raises:
        EnvironmentCheckError: the first contract violation found, with what to fix.
    """
    with asyncio.Runner() as runner:
        env, owned = _instantiate(env_or_cls)
        name = type(env).__qualname__
        tools = _check_tools(env, name)
        _check_signatures(env, name)
        for _ in range(episodes):
            prompt = _resolve(runner, env.reset(**dict(reset_kwargs or {})), f"{name}.reset")  # type: ignore[attr-defined]
            if prompt is not None and not isinstance(prompt, str):
                raise EnvironmentCheckError(
                    f"{name}.reset returned {type(prompt).__name__}; it must return str or None")
            if callable(getattr(env, "get_reward", None)):
                _check_reward(_resolve(runner, env.get_reward(), f"{name}.get_reward"), name)  # type: ignore[attr-defined]
        if not tools:
            warnings.warn(f"{name} exposes no tools: the model can only answer in text", UserWarning, stacklevel=2)
        if owned and callable(getattr(env, "close", None)):
            _resolve(runner, env.close(), f"{name}.close")  # type: ignore[attr-defined]


def _instantiate(env_or_cls: object) -> tuple[object, bool]:
    if not isinstance(env_or_cls, type):
        return env_or_cls, False
    cls = env_or_cls
    try:
        pickle.dumps(cls)
    except Exception as exc:
        raise EnvironmentCheckError(
            f"{cls.__qualname__} does not pickle ({exc}); define it at module level so the trainer's "
            "worker process and the env server can import it"
        ) from exc
    try:
        return cls(), True
    except Exception as exc:
        raise EnvironmentCheckError(
            f"{cls.__qualname__}() raised {type(exc).__name__}: {exc}; an environment must construct "
            "with no arguments (bind parameters with functools.partial)"
        ) from exc


def _check_tools(env: object, name: str) -> list[Any]:
    try:
        tools = environment_tools(env)
    except ToolDefinitionError as exc:
        raise EnvironmentCheckError(f"{name}: a public method is not a valid tool: {exc}") from exc
    for tool in tools:
        if not _TOOL_NAME.match(tool.name):
            raise EnvironmentCheckError(f"{name}: tool name {tool.name!r} must match {_TOOL_NAME.pattern}")
    return tools


def _check_signatures(env: object, name: str) -> None:
    reset = getattr(env, "reset", None)
    if not callable(reset):
        raise EnvironmentCheckError(f"{name} has no reset(**kwargs) method")
    params = inspect.signature(reset).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise EnvironmentCheckError(
            f"{name}.reset must accept **kwargs: a dataset row's columns arrive as keyword arguments"
        )
    for hook in ("get_reward", "close"):
        method = getattr(env, hook, None)
        if method is None:
            continue
        if not callable(method):
            raise EnvironmentCheckError(f"{name}.{hook} is reserved for a method, got {type(method).__name__}")
        required = [p.name for p in inspect.signature(method).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if required:
            raise EnvironmentCheckError(f"{name}.{hook} must take no arguments, takes {', '.join(required)}")


def _check_reward(reward: object, name: str) -> None:
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise EnvironmentCheckError(f"{name}.get_reward returned {type(reward).__name__}; it must return a float")
    if not math.isfinite(reward):
        raise EnvironmentCheckError(f"{name}.get_reward returned {reward}; rewards must be finite")


def _resolve(runner: asyncio.Runner, value: Any, where: str) -> Any:
    """Await ``value`` on the checker's loop when a hook is async."""
    if not inspect.isawaitable(value):
        return value
    try:
        return runner.run(cast("Coroutine[Any, Any, Any]", value))
    except RuntimeError as exc:
        if "running event loop" in str(exc):
            raise EnvironmentCheckError(f"{where} is async: call check_env outside a running event loop") from exc
        raise
