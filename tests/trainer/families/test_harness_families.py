"""The harness endpoint speaks every family: its replies carry OpenAI ``tool_calls`` (streamed too) and
``reasoning_content``, and an agent echoing them back extends one sample, each generated token trained once.

The sampler is a script answering with an episode in the family's format (as token ids of the tiny
tokenizer given the family's tokens, then the family's end token); the agent is the ``openai`` client.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.trainer.families.family_kit import COUNTER_TOOLS, episode, family_tokenizer
from trainer.families import Family, families, template_text
from trainer.metrics import RecordBuffer
from trainer.records import TurnRecord
from trainer.rollout.harness import CaptureServer
from trainer.rollout.reconcile import reconcile_turns

SHIPPED = [f for f in families() if f.training_template is not None][:8]


def _sampler(tokenizer: Any, family: Family, texts: list[str]) -> Any:
    answered: list[int] = []

    async def sample(prompt_ids: list[int], max_tokens: int | None, stop: list[str]) -> TurnRecord:
        text = texts[len(answered)]
        answered.append(1)
        has_calls = bool(family.parse(text, COUNTER_TOOLS)[1])
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(int(tokenizer.convert_tokens_to_ids(family.turn_end(has_calls))))
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=[-0.5] * len(ids),
                          finish_reason="stop")

    return sample


async def _ask(client: openai.AsyncOpenAI, messages: list[Any], stream: bool) -> dict[str, Any]:
    """One reply as a message dict (a streamed one put together from its chunks) and its finish reason."""
    if not stream:
        reply = await client.chat.completions.create(model="x", messages=messages, tools=COUNTER_TOOLS)
        return {**reply.choices[0].message.model_dump(exclude_none=True), "finish": reply.choices[0].finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    async for chunk in await client.chat.completions.create(model="x", messages=messages, tools=COUNTER_TOOLS,
                                                            stream=True):
        choice = chunk.choices[0]
        delta = choice.delta.model_dump(exclude_none=True)
        message["content"] += delta.get("content") or ""
        if "reasoning_content" in delta:
            message["reasoning_content"] = delta["reasoning_content"]
        for call in delta.get("tool_calls", []):
            message.setdefault("tool_calls", []).append(
                {"id": call["id"], "type": "function", "function": call["function"]})
        if choice.finish_reason:
            message["finish"] = choice.finish_reason
    return message


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("family", SHIPPED, ids=[f.name for f in SHIPPED])
def test_an_agent_talks_to_every_family(family: Family, stream: bool, tiny_model_dir: Path) -> None:
    tokenizer = family_tokenizer(tiny_model_dir, family, template_text(str(family.training_template)))
    texts = episode(family)

    async def go() -> tuple[Any, list[dict[str, Any]]]:
        server = CaptureServer(_sampler(tokenizer, family, texts), tokenizer, "tiny", max_model_len=4096,
                               records=RecordBuffer())
        await server.start()
        session = server.open(contextvars.copy_context(), max_requests=8)
        replies = []
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.secret, max_retries=0) as client:
            messages: list[Any] = [{"role": "system", "content": "Count."}, {"role": "user", "content": "To 4."}]
            for _ in texts:
                reply = await _ask(client, messages, stream)
                replies.append(reply)
                finish = reply.pop("finish")
                messages.append(reply)
                calls = reply.get("tool_calls", [])
                assert finish == ("tool_calls" if calls else "stop")
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": str(i)} for i, c in enumerate(calls)]
        server.close(session)
        await server.stop()
        return session, replies

    session, replies = asyncio.run(go())
    calls = [[(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r.get("tool_calls", [])]
             for r in replies]
    assert calls == [[("increment", {"step": 2})], [("increment", {"step": 1})] * 2, []]
    assert replies[-1]["content"] == "The counter is 4."
    if family.reasoning is not None or family.name == "gpt_oss":
        assert replies[0].get("reasoning_content") == "Start with two.", "the reasoning is set apart"
        assert "Start with two" not in (replies[0].get("content") or "")
    sequences, stats = reconcile_turns(session.turns)
    assert stats.forks == 0 and len(sequences) == 1, "the echoed replies render as generated: one sample"
    trained = [t for t, m in zip(sequences[0].input_ids, sequences[0].loss_mask, strict=True) if m]
    assert trained == [t for turn in session.turns for t in turn.output_ids], "every generated token trained once"
    assert session.tool_calls == 3 and session.tool_failures == 0
