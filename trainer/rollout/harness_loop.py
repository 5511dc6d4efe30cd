"""``HarnessRolloutLoop``: the rollout loop whose rollouts are a user's agent talking to the capture endpoint.

The loop keeps everything of :class:`~trainer.rollout.loop.AsyncRolloutLoop` (groups, the three
concurrency limits, environments, scoring, reconciliation, metrics) and replaces one step:
:meth:`~HarnessRolloutLoop.run_rollout` opens a :class:`~trainer.rollout.harness.CaptureSession`,
runs the agent against it (:func:`~trainer.rollout.agents.run_agent`), closes it and turns the
recorded turns into the :class:`~trainer.records.Rollout` the group is scored and trained on. The
endpoint (:class:`~trainer.rollout.harness.CaptureServer`) starts in :meth:`setup` and stops in
:meth:`close`, on the worker's event loop. The agent's limits and the endpoint's address come from the
trainer's :class:`~trainer.harness_trainer.HarnessAsyncGRPOConfig` as a :class:`HarnessSettings`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any

from sdk.tools import Tool
from trainer.exceptions import RolloutFailed
from trainer.harness_config import HarnessAsyncGRPOConfig
from trainer.records import Rollout, TurnRecord
from trainer.rollout.agents import AgentTask, check_agent, run_agent
from trainer.rollout.harness import CaptureServer, CaptureSession, InProcessTransport
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.settings import declared_default

__all__ = ["HarnessRolloutLoop", "HarnessSettings"]


def _default(name: str) -> Any:
    return field(default=declared_default(HarnessAsyncGRPOConfig, name))


@dataclass(frozen=True)
class HarnessSettings:
    """The harness loop's own settings: the :class:`~trainer.harness_trainer.HarnessAsyncGRPOConfig`
    fields of the same names (see their help), defaulting to theirs.

    Attributes:
        agent_timeout: Seconds an agent has for one rollout.
        agent_max_requests: Chat requests one rollout may make.
        agent_parallel_requests: Requests of one rollout sampled at once.
        harness_host: Address the capture endpoint listens on.
        harness_port: The endpoint's port (0: a free one).
        harness_max_request_bytes: Largest request body the endpoint reads.
    """

    agent_timeout: float = _default("agent_timeout")
    agent_max_requests: int = _default("agent_max_requests")
    agent_parallel_requests: int = _default("agent_parallel_requests")
    harness_host: str = _default("harness_host")
    harness_port: int = _default("harness_port")
    harness_max_request_bytes: int = _default("harness_max_request_bytes")

    @classmethod
    def from_config(cls, config: HarnessAsyncGRPOConfig) -> HarnessSettings:
        """The fields of ``config`` of the same names."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


def captured_completion(session: CaptureSession) -> list[dict[str, Any]]:
    """The conversation the reward functions get: the last request from its first assistant message
    on (the leading system / user messages are the prompt), then the last reply."""
    messages = session.conversation
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages) - 1)
    return messages[first:]


def _shared_http_client(capture: CaptureServer) -> Any:
    """One HTTP client for every rollout's ``openai`` client (``None`` without the package): its requests
    to the endpoint are answered in process (:class:`~trainer.rollout.harness.InProcessTransport`)."""
    try:
        import openai
    except ImportError:
        return None
    client_class = openai.DefaultAsyncHttpxClient
    # openai's HTTP library: httpx, or httpx2 in later releases (the client's base class tells which).
    base = next(c for c in client_class.__mro__ if c.__name__ == "AsyncClient")
    httpx = importlib.import_module(base.__module__.split(".")[0])
    transport: Any = InProcessTransport(capture, httpx)  # duck-typed: the base class is httpx's or httpx2's
    return client_class(transport=transport)


class HarnessRolloutLoop(AsyncRolloutLoop):
    """The rollout loop of :class:`~trainer.harness_trainer.HarnessAsyncGRPOTrainer`.

    Args:
        *args: As :class:`~trainer.rollout.loop.AsyncRolloutLoop`.
        agent: The agent (see :func:`~trainer.rollout.agents.check_agent`).
        harness: The agent's limits and the endpoint's address; ``None``: the defaults.
        **kwargs: As :class:`~trainer.rollout.loop.AsyncRolloutLoop`.
    """

    def __init__(self, *args: Any, agent: Any, harness: HarnessSettings | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent = check_agent(agent)
        self.harness = harness or HarnessSettings()
        self.capture: CaptureServer | None = None
        self._http_client: Any = None

    async def setup(self) -> None:
        """Start the capture endpoint."""
        await super().setup()
        s, h = self.settings, self.harness
        self.capture = CaptureServer(
            self._sample, self.tokenizer, s.model_name, s.server.max_model_len, self.records, s.chat_template,
            dict(s.chat_template_kwargs), host=h.harness_host, port=h.harness_port,
            max_request_bytes=h.harness_max_request_bytes)
        await self.capture.start()
        self._http_client = _shared_http_client(self.capture)

    async def close(self) -> None:
        """Stop the capture endpoint."""
        if self._http_client is not None:
            await self._http_client.aclose()
        if self.capture is not None:
            await self.capture.stop()
        await super().close()

    async def _sample(self, prompt_ids: list[int], max_tokens: int | None, stop: list[str]) -> TurnRecord:
        """One request's turn: the trainer's sampling settings, at most the request's ``max_tokens``
        (and what fits the server's ``max_model_len``)."""
        room = self.settings.server.max_model_len - len(prompt_ids)
        limit = min(self.params.max_tokens, max_tokens or self.params.max_tokens, room)
        return await self.generate_one_turn(prompt_ids, dataclasses.replace(self.params, max_tokens=limit))

    async def run_rollout(self, row: dict[str, Any], prompt: list[dict[str, Any]], tools: list[Tool], env: Any,
                          group_id: int = 0) -> Rollout:
        """Run the agent on its own endpoint session; its turns become the rollout.

        Raises:
            RolloutFailed: The agent raised, exited non-zero, was cut at ``agent_timeout`` or made
                no request: only this rollout fails.
        """
        assert self.capture is not None, "setup() starts the endpoint"
        h = self.harness
        # The session samples in this rollout's context: its group's policy version (LoRA adapter).
        session = self.capture.open(contextvars.copy_context(), h.agent_max_requests, h.agent_parallel_requests)
        task = AgentTask(row=row, prompt=prompt, tools=[t.schema for t in tools], env=env, base_url=session.base_url,
                         api_key=session.secret, model=self.settings.model_name, timeout_s=h.agent_timeout,
                         env_tools=tools, executor=self.executor, http_client=self._http_client)
        try:
            outcome = await run_agent(self.agent, task, cancel=session.failed)
        finally:
            self.capture.close(session)
        self.records.add("agent/duration_s", outcome.wall_s)
        self.records.add("agent/requests_mean", session.requests)
        self.records.add("agent/timeout_count", int(outcome.timed_out))
        self.records.add("agent/failed_count", int(outcome.error is not None and not outcome.timed_out))
        if session.saw_tools:  # as the built-in loop: tool metrics only for rollouts shown tools
            self.records.add("tools/call_frequency", session.tool_calls)
            self.records.add("tools/loop_exhausted_frac", float(session.exhausted))
            self.records.add_rate("tools/failure_frequency", 0, 0)
        if session.fatal is not None:
            raise session.fatal
        if outcome.error is not None:
            raise RolloutFailed(f"the agent failed: {outcome.error}")
        if not session.turns:
            raise RolloutFailed("the agent made no request to its endpoint: nothing to train")
        return Rollout(completion=captured_completion(session),
                       completion_ids=[t for turn in session.turns for t in turn.output_ids], turns=list(session.turns),
                       tool_call_count=session.tool_calls, tool_failure_count=session.tool_failures,
                       reward=outcome.reward)
