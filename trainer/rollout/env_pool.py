"""Environment instances for rollouts: one per rollout in flight, reused across episodes.

``environment_factory`` is a zero-argument callable, or a dict name -> callable routed by the
dataset's ``environment`` column. An instance is taken for one rollout, ``reset`` between episodes,
and returned to its pool afterwards, so an expensive ``__init__`` runs once per concurrent slot
rather than once per episode. :func:`reset_environment` and :func:`environment_reward` open and
score an episode.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from sdk.exceptions import ServerUnavailableError
from trainer.exceptions import RolloutFailed
from trainer.metrics import RecordBuffer
from trainer.rollout.tool_runner import call_with_timeout

EnvironmentFactory = Callable[[], Any]


class EnvironmentPool:
    """Free lists of environment instances per environment name.

    Args:
        factory: A callable, or a dict of name -> callable; ``None`` when there is no environment.
    """

    def __init__(self, factory: EnvironmentFactory | dict[str, EnvironmentFactory] | None) -> None:
        if factory is None:
            self.factories: dict[str | None, EnvironmentFactory] = {}
        elif isinstance(factory, dict):
            self.factories = {name: f for name, f in factory.items()}  # a copy, typed with the None key
        else:
            self.factories = {None: factory}
        self._free: dict[str | None, list[Any]] = {name: [] for name in self.factories}
        self._all: list[Any] = []

    @property
    def enabled(self) -> bool:
        """Whether rollouts run with environments."""
        return bool(self.factories)

    @property
    def routed(self) -> bool:
        """Whether the dataset's ``environment`` column chooses the environment."""
        return None not in self.factories and bool(self.factories)

    def resolve(self, row: dict[str, Any]) -> str | None:
        """The environment name a dataset row routes to (``None`` for a single factory)."""
        if not self.routed:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise KeyError(f"dataset row routes to environment {name!r}, but environment_factory only has "
                           f"{sorted(self.factories, key=str)} (set the row's 'environment' column to one of them)")
        return name

    def acquire(self, name: str | None) -> Any:
        """An idle instance of environment ``name`` (a new one when none is idle)."""
        free = self._free[name]
        if free:
            return free.pop()
        env = self.factories[name]()
        self._all.append(env)
        return env

    def release(self, name: str | None, env: Any) -> None:
        """Return an instance after its rollout."""
        self._free[name].append(env)

    def discard(self, env: Any) -> None:
        """Forget an instance whose episode failed (its state is unknown); it is closed later."""
        for free in self._free.values():
            if env in free:
                free.remove(env)

    async def aclose(self) -> None:
        """Close every instance that offers ``aclose`` or ``close``."""
        for env in self._all:
            closer = getattr(env, "aclose", None) or getattr(env, "close", None)
            if closer is None:
                continue
            try:
                result = closer()
                if inspect.isawaitable(result):
                    await asyncio.wait_for(result, timeout=5)
            except Exception:  # closing is best effort: the process is ending
                pass
        self._all.clear()


async def reset_environment(env: Any, row: dict[str, Any], prompt: list[dict[str, Any]], executor: Executor,
                            records: RecordBuffer, timeout_s: float | None = None) -> list[dict[str, Any]]:
    """Start an episode: ``env.reset(**row's other columns)``; its text joins the prompt's last user
    message (or is a new one). Records ``env/reset_s``.

    Raises:
        RolloutFailed: ``reset`` raised or ran past ``timeout_s`` (``env_call_timeout``): only this rollout fails.
        ServerUnavailableError: A new session found no env server (any replica) up: the run stops, naming them.
    """
    kwargs = {k: v for k, v in row.items() if k not in ("prompt", "environment")}
    t0 = time.monotonic()
    try:
        text = await call_with_timeout(env.reset, executor, timeout_s, f"{type(env).__name__}.reset", **kwargs)
    except (ServerUnavailableError, RolloutFailed):
        raise
    except Exception as exc:
        raise RolloutFailed(f"{type(env).__name__}.reset raised {type(exc).__name__}: {exc}") from exc
    records.add("env/reset_s", time.monotonic() - t0)
    if text is None:
        return prompt
    if prompt and prompt[-1].get("role") == "user":
        last = dict(prompt[-1])
        last["content"] = f"{last.get('content') or ''}{text}"
        return [*prompt[:-1], last]
    return [*prompt, {"role": "user", "content": str(text)}]


async def environment_reward(env: Any, executor: Executor, records: RecordBuffer,
                             timeout_s: float | None = None) -> tuple[type, float] | None:
    """The episode's ``(environment class, get_reward())``; ``None`` without a ``get_reward`` or a
    reward. Records ``env/reward_s``.

    Raises:
        RolloutFailed: ``get_reward`` ran past ``timeout_s`` (``env_call_timeout``).
    """
    get_reward = getattr(env, "get_reward", None)
    if get_reward is None:
        return None
    t0 = time.monotonic()
    value = await call_with_timeout(get_reward, executor, timeout_s, f"{type(env).__name__}.get_reward")
    records.add("env/reward_s", time.monotonic() - t0)
    return None if value is None else (type(env), float(value))
