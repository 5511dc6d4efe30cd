"""Running the tool calls a model emitted: local functions and environment methods, sync or async.

A tool is a :class:`sdk.Tool` (name, JSON schema, callable): a function from ``tools=[...]``, a
method of a local environment, or a method of a remote one (an async call over its session), so
all three look the same here. Sync callables run on a thread pool (``max_concurrent_rollouts``
threads) so a slow tool only slows its own rollout; async ones are awaited on the loop. Calls run
in the order the model emitted them. A malformed call, an unknown name or a tool that raises
becomes an ``Error: ...`` tool message for the model and is counted, never a crash; a lost env
server or session (an ``sdk`` infrastructure error) fails the rollout instead.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from sdk.exceptions import ToolCallError, ToolgymError, UnknownToolError
from sdk.tools import Tool, tool_from_function
from trainer.exceptions import RolloutFailed
from trainer.records import TOOL_ERROR_PREFIX


def tools_from_functions(funcs: Sequence[Callable[..., Any]] | None) -> list[Tool]:
    """Describe the trainer's ``tools=[...]`` (registered by ``__name__``)."""
    return [tool_from_function(f) for f in funcs or []]


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


async def call_with_timeout(func: Callable[..., Any], executor: Executor | None, timeout_s: float | None,
                            what: str, /, **kwargs: Any) -> Any:
    """:func:`call_maybe_async` bounded by ``timeout_s`` (``env_call_timeout``; ``None``: no bound).

    Raises:
        RolloutFailed: the call ran past ``timeout_s``, naming ``what`` (an async call is cancelled; a sync
            one's thread cannot be, and finishes on its own).
    """
    if timeout_s is None:
        return await call_maybe_async(func, executor, **kwargs)
    try:
        return await asyncio.wait_for(call_maybe_async(func, executor, **kwargs), timeout_s)
    except TimeoutError:
        raise RolloutFailed(f"{what} ran past env_call_timeout={timeout_s:g} s; the rollout fails and its "
                            "environment is discarded") from None


async def call_maybe_async(func: Callable[..., Any], executor: Executor | None, /, **kwargs: Any) -> Any:
    """Await ``func(**kwargs)`` when it is a coroutine function, else run it on ``executor``."""
    # An object with an async __call__ (not a callability test: B004 does not apply).
    if asyncio.iscoroutinefunction(func) or asyncio.iscoroutinefunction(getattr(func, "__call__", None)):  # noqa: B004
        return await func(**kwargs)
    result = await asyncio.get_running_loop().run_in_executor(executor, functools.partial(func, **kwargs))
    if asyncio.iscoroutine(result):  # a sync wrapper that returned a coroutine
        result = await result
    return result


@dataclass
class ToolCallOutcome:
    """One executed (or refused) call: the message for the model and what to count."""

    name: str | None
    content: str
    failed: bool
    unknown: bool
    latency_s: float


@dataclass
class ToolRunner:
    """Executes parsed tool calls against one rollout's tools.

    Args:
        tools: The tools shown to the model for this rollout.
        executor: Thread pool for sync tools.
        timeout_s: ``env_call_timeout``: a call past it fails the rollout (``None``: no bound).
    """

    tools: Sequence[Tool]
    executor: Executor | None = None
    timeout_s: float | None = None
    _by_name: dict[str, Tool] = field(init=False)

    def __post_init__(self) -> None:
        self._by_name = {t.name: t for t in self.tools}

    async def run(self, call: Mapping[str, Any]) -> ToolCallOutcome:
        """Execute one parsed call (a ``ToolCall`` or ``ToolCallFailure`` of
        :func:`trainer.rollout.chat_template.parse_tool_calls`)."""
        name = call.get("name")
        if "error" in call:
            return ToolCallOutcome(name, f"{TOOL_ERROR_PREFIX}{call['error']}", failed=True, unknown=False,
                                   latency_s=0.0)
        tool = self._by_name.get(name)  # type: ignore[arg-type]
        if tool is None:
            available = ", ".join(sorted(self._by_name)) or "none"
            return ToolCallOutcome(name, f"{TOOL_ERROR_PREFIX}unknown tool {name!r}; available tools: {available}",
                                   failed=True, unknown=True, latency_s=0.0)
        t0 = time.perf_counter()
        try:
            result = await call_with_timeout(tool.func, self.executor, self.timeout_s, f"tool {name!r}",
                                             **call["arguments"])
        except ToolCallError as exc:  # a remote tool failed: the server already phrased it for the model
            return ToolCallOutcome(name, f"{TOOL_ERROR_PREFIX}{exc}", failed=True,
                                   unknown=isinstance(exc, UnknownToolError), latency_s=time.perf_counter() - t0)
        except ToolgymError:
            raise  # the env server or the session is gone: the rollout fails, not the tool
        except Exception as exc:  # the tool's failure is the model's observation
            return ToolCallOutcome(name, f"{TOOL_ERROR_PREFIX}{type(exc).__name__}: {exc}", failed=True, unknown=False,
                                   latency_s=time.perf_counter() - t0)
        return ToolCallOutcome(name, _as_text(result), failed=False, unknown=False,
                               latency_s=time.perf_counter() - t0)
