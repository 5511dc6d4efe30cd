"""Running a user's agent for one rollout: an async Python callable, or a command line as a subprocess.

An agent receives an :class:`AgentTask` (the dataset row, the prompt, the environment and its tools,
the rollout's OpenAI-compatible base URL and key, a ready ``openai.AsyncOpenAI`` client) and plays
the episode against that endpoint. A callable returns the reward, or ``None`` to leave scoring to
the reward functions and the environment. A command gets ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``
and ``OPENAI_MODEL`` in its environment and the task as JSON on stdin (``prompt``, ``row``,
``tools``, ``model``); the last line it prints, when it is a number, is its reward. A command
runs in its own process group, killed whole when the rollout ends, so nothing it started
outlives it. :func:`run_agent` cuts an agent at the rollout's deadline and reports a crash or a
non-zero exit as an :class:`AgentOutcome` with its error, never as an exception: one agent's
failure fails only its rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import shlex
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from sdk.tools import Tool
from trainer.exceptions import AgentCommandError, ConfigError
from trainer.rollout.tool_runner import ToolRunner

__all__ = ["Agent", "AgentOutcome", "AgentTask", "check_agent", "run_agent"]

logger = logging.getLogger(__name__)

Agent = Callable[["AgentTask"], Awaitable[float | None]] | str | Sequence[str]
"""An async callable taking an :class:`AgentTask`, or a command line (a string split like a shell
would, or a list of arguments)."""

_OUTPUT_TAIL = 64 * 1024  # bytes of a command's stdout / stderr kept (the reward line, the error)
_CANCEL_GRACE_S = 2.0  # a cancelled callable that has not stopped by then is abandoned
_PIPE_DRAIN_S = 1.0


def check_agent(agent: Any) -> Callable[..., Any] | list[str]:
    """The agent as a coroutine function or an argument list; a :class:`ConfigError` otherwise."""
    if isinstance(agent, str):
        agent = shlex.split(agent)
    if isinstance(agent, Sequence) and not isinstance(agent, str):
        argv = list(agent)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigError(f"a command agent must be a non-empty list of strings, got {agent!r}")
        return argv
    if inspect.iscoroutinefunction(agent) or (callable(agent) and inspect.iscoroutinefunction(agent.__call__)):
        return agent  # type: ignore[no-any-return]
    raise ConfigError(f"agent must be an async function taking an AgentTask (async def agent(task): ...) or a "
                      f"command line, got {agent!r}; a sync agent would block the rollout worker's event loop")


@dataclass
class AgentTask:
    """What an agent gets for one rollout.

    Attributes:
        row: The dataset row (every column; empty when the environment owns the data).
        prompt: The conversation to start from: the row's ``prompt`` with the environment's
            ``reset()`` text appended, as the built-in loop builds it (may be empty).
        tools: OpenAI function schemas of the environment's tools, ready for ``tools=``.
        env: The rollout's environment instance (``None`` without ``environment_factory``); its
            ``get_reward`` is called after the agent returns.
        base_url: The rollout's OpenAI-compatible base URL (``.../v1``, the secret in the path).
        api_key: The rollout's secret, as an API key.
        model: The model name to send (any name is accepted).
        timeout_s: Seconds the agent has before it is cut (``agent_timeout``).
    """

    row: dict[str, Any]
    prompt: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    env: Any
    base_url: str
    api_key: str
    model: str
    timeout_s: float
    env_tools: list[Tool] = field(default_factory=list, repr=False)
    executor: Executor | None = field(default=None, repr=False)
    http_client: Any = field(default=None, repr=False)  # the loop's shared httpx client for ``client``

    @functools.cached_property
    def client(self) -> Any:
        """An ``openai.AsyncOpenAI`` on this rollout's endpoint (closed when the rollout ends).

        Its retries are off: the worker's sampler client already retries the sampler. Its HTTP
        client is the loop's shared one (``http_client``), which answers requests to the endpoint
        in process, without a loopback socket (:class:`~trainer.rollout.harness.InProcessTransport`):
        a client of its own would build a TLS context per rollout, about 0.1 s of CPU, more than
        the rest of the rollout, and pay a loopback HTTP round trip per request.
        """
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0,
                                  timeout=self.timeout_s, http_client=self.http_client)

    async def call_tool(self, name: str, arguments: str | dict[str, Any]) -> str:
        """Run one of the environment's tools as the built-in loop does, for a tool message.

        A malformed call, an unknown name or a tool that raises comes back as ``"Error: ..."``
        (what :func:`trainer.rewards.tool_error_penalty` counts), never as an exception.

        Args:
            name: The tool's name (``tool_call.function.name``).
            arguments: Its arguments, as the JSON string of the reply or as a dict.
        """
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                arguments = {"__invalid__": str(exc)}
        call: dict[str, Any] = {"name": name, "arguments": arguments}
        if not isinstance(arguments, dict) or "__invalid__" in arguments:
            call = {"name": name, "arguments": None, "error": f"invalid tool call arguments for {name!r}"}
        outcome = await ToolRunner(self.env_tools, self.executor).run(call)
        return outcome.content

    def payload(self) -> dict[str, Any]:
        """The JSON a command agent reads on stdin."""
        return {"prompt": self.prompt, "row": self.row, "tools": self.tools, "model": self.model}

    async def aclose(self) -> None:
        """Close the client if the agent used it (not the shared connection pool)."""
        if "client" in self.__dict__ and self.http_client is None:
            await self.client.close()


@dataclass
class AgentOutcome:
    """How an agent's rollout ended.

    Attributes:
        reward: What the agent returned (``None``: the other reward sources score it).
        error: Why it failed (it raised, exited non-zero, returned a non-number); ``None`` when it did not.
        timed_out: It was cut at the deadline.
        wall_s: Seconds it ran.
    """

    reward: float | None = None
    error: str | None = None
    timed_out: bool = False
    wall_s: float = 0.0


def _as_reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"the agent returned {value!r}; return a number or None")
    return float(value)


async def run_agent(agent: Callable[..., Any] | list[str], task: AgentTask, cancel: asyncio.Event | None = None,
                    ) -> AgentOutcome:
    """Run ``agent`` on ``task`` until it returns, fails, passes ``task.timeout_s`` or ``cancel`` is set.

    Args:
        agent: As returned by :func:`check_agent`.
        task: The rollout's task.
        cancel: Set when the rollout must stop early (its endpoint hit a fatal error).
    """
    t0 = time.monotonic()
    job = asyncio.ensure_future(_run_command(agent, task) if isinstance(agent, list) else agent(task))
    waits: set[asyncio.Future[Any]] = {job}
    stop = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
    if stop is not None:
        waits.add(stop)
    try:
        await asyncio.wait(waits, timeout=task.timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if stop is not None:
            stop.cancel()
        if not job.done():
            job.cancel()
            done, _ = await asyncio.wait({job}, timeout=_CANCEL_GRACE_S)
            if not done:
                logger.warning("the agent ignored its cancellation for %.0f s; abandoned", _CANCEL_GRACE_S)
        await task.aclose()
    wall_s = time.monotonic() - t0
    if job.cancelled() or not job.done():
        timed_out = cancel is None or not cancel.is_set()
        error = f"cut at the {task.timeout_s:g} s deadline (agent_timeout)" if timed_out else "stopped"
        return AgentOutcome(error=error, timed_out=timed_out, wall_s=wall_s)
    exc = job.exception()
    if exc is not None:
        return AgentOutcome(error=f"{type(exc).__name__}: {exc}", wall_s=wall_s)
    try:
        return AgentOutcome(reward=_as_reward(job.result()), wall_s=wall_s)
    except TypeError as exc:
        return AgentOutcome(error=str(exc), wall_s=wall_s)


async def _tail(stream: asyncio.StreamReader) -> bytes:
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-_OUTPUT_TAIL:]
    return kept


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stdin.write(data)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command does not read its task: fine


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the command's own session: it and whatever it started
    except (ProcessLookupError, PermissionError):
        pass


async def _run_command(argv: list[str], task: AgentTask) -> float | None:
    """Run a command agent; its reward is its last stdout line when that is a number."""
    env = {**os.environ, "OPENAI_BASE_URL": task.base_url, "OPENAI_API_KEY": task.api_key, "OPENAI_MODEL": task.model}
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        data = json.dumps(task.payload(), ensure_ascii=False, default=str).encode()
        _, out, err, code = await asyncio.gather(_feed(proc.stdin, data), _tail(proc.stdout), _tail(proc.stderr),
                                                 proc.wait())
    finally:
        _kill_group(proc.pid)
        if proc.returncode is None:
            await proc.wait()
        # The transport closes once its pipes are at EOF: see that through (bounded: a child that left
        # the process group could hold a pipe open), so no pipe outlives the rollout.
        proc.stdin.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(proc.stdout.read(), proc.stderr.read()), _PIPE_DRAIN_S)
    if code != 0:
        raise AgentCommandError(f"{shlex.join(argv)} exited with status {code}; stderr ends with:\n"
                            f"{err.decode(errors='replace')[-2000:]}")
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    try:
        return _as_reward(json.loads(lines[-1])) if lines else None
    except (json.JSONDecodeError, TypeError):
        return None
