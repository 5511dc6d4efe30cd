"""Agents and a recording loop for the harness tests (module level: they reach the spawned rollout worker).

:func:`counter_agent` is what a user would write with the ``openai`` package: function calling on
the counter environment's tools through the rollout's endpoint. Rollouts take turns at behaving
as :data:`MODES` say (streamed replies, a history the agent rewrites, a crash, a hang), so one
training run exercises all of them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

from trainer.exceptions import RolloutFailed
from trainer.harness_trainer import HarnessAsyncGRPOTrainer
from trainer.records import Rollout
from trainer.rollout.agents import AgentTask
from trainer.rollout.harness_loop import HarnessRolloutLoop
from trainer.rollout.reconcile import reconcile_turns

MODES = ("normal", "stream", "rewrite", "crash", "normal", "hang", "stream", "normal")
MAX_TURNS = 6
_next_rollout = itertools.count()


async def _create(task: AgentTask, messages: list[dict[str, Any]], stream: bool) -> tuple[dict[str, Any], int]:
    """One chat request; the reply as a message to send back, and the tokens the server says it generated."""
    if not stream:
        reply = await task.client.chat.completions.create(model=task.model, messages=messages, tools=task.tools)
        return reply.choices[0].message.model_dump(exclude_none=True), reply.usage.completion_tokens
    chunks = await task.client.chat.completions.create(model=task.model, messages=messages, tools=task.tools,
                                                       stream=True, stream_options={"include_usage": True})
    content, calls, used = "", {}, 0
    async for chunk in chunks:
        used = chunk.usage.completion_tokens if chunk.usage else used
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += tc.function.name or ""
                entry["function"]["arguments"] += tc.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, used


async def counter_agent(task: AgentTask) -> None:
    """Play the counter episode with OpenAI function calling; the environment scores it (returns None)."""
    mode = MODES[next(_next_rollout) % len(MODES)]
    task.env.harness_mode, task.env.harness_seen_tokens = mode, 0
    messages = list(task.prompt)
    for _ in range(MAX_TURNS):
        message, used = await _create(task, messages, stream=mode == "stream")
        task.env.harness_seen_tokens += used
        if mode == "crash":
            raise RuntimeError("the agent's parser broke")
        if mode == "hang":
            await asyncio.Event().wait()
        messages.append(message)
        if not message.get("tool_calls"):
            return None
        results = []
        for call in message["tool_calls"]:
            content = await task.call_tool(call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
            results.append(content)
        if mode == "rewrite":  # keeps only a summary of what happened: the next prompt forks
            messages = [*task.prompt, {"role": "user", "content": f"Tool results so far: {', '.join(results)}."}]
    return None


class RecordingHarnessLoop(HarnessRolloutLoop):
    """Writes, per rollout, what the test checks to ``<record_dir>/rollouts.jsonl``."""

    def __init__(self, *args: Any, record_dir: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record_dir = Path(record_dir)

    async def run_rollout(self, row: dict[str, Any], prompt: list[dict[str, Any]], tools: list[Any], env: Any,
                          group_id: int = 0) -> Rollout:
        """The harness rollout, recorded."""
        record: dict[str, Any] = {}
        try:
            rollout = await super().run_rollout(row, prompt, tools, env, group_id)
        except RolloutFailed as exc:
            record = {"failed": str(exc)}
            raise
        else:
            sequences, stats = reconcile_turns(rollout.turns)
            trained = [i for s in sequences for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m]
            record = {"turns": len(rollout.turns), "forks": stats.forks, "sequences": len(sequences),
                      "generated": rollout.completion_ids, "trained": trained,
                      "tool_calls": rollout.tool_call_count, "completion": rollout.completion}
            return rollout
        finally:
            record.update(mode=getattr(env, "harness_mode", None), seen_tokens=getattr(env, "harness_seen_tokens", 0))
            with open(self.record_dir / "rollouts.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")


class RecordingHarnessTrainer(HarnessAsyncGRPOTrainer):
    """The harness trainer with :class:`RecordingHarnessLoop`, recording into the run's ``output_dir``."""

    loop_cls = RecordingHarnessLoop

    def rollout_loop_kwargs(self) -> dict[str, Any]:
        """The harness loop's arguments and the folder it records into."""
        return {**super().rollout_loop_kwargs(), "record_dir": self.args.output_dir}
