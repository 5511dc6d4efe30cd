"""Attacks on the capture endpoint, each bounded before it costs memory or loop time (scripted sampler,
real aiohttp server and real ``openai`` / aiohttp clients; see ``test_harness_endpoint.py``).

(a) requests past ``agent_max_requests`` are refused on arrival, not after waiting for the slot;
(b) an agent that hangs up cancels its sampling, and no turn is recorded; (c) a request waiting for the
rollout's slot has not read its body; (d) a refused request leaves no renderer behind; (e) rendering a
huge request does not stall the event loop; (f) a malformed ``tools`` entry is refused before sampling.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from tests.trainer.rollout.test_harness_endpoint import INCREMENT, ScriptedSampler, _client, _server, run


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny model's tokenizer."""
    return AutoTokenizer.from_pretrained(tiny_model_dir)


HELLO = [{"role": "user", "content": "Hi."}]


def test_requests_past_the_limit_are_refused_on_arrival(tokenizer: Any) -> None:
    async def go() -> None:
        sampler = ScriptedSampler(tokenizer, ["ok"], delay_s=0.05)
        server = await _server(tokenizer, sampler)
        session = server.open(contextvars.copy_context(), max_requests=5)
        async with _client(session) as client:
            results = await asyncio.gather(
                *(client.chat.completions.create(model="x", messages=HELLO) for _ in range(40)),
                return_exceptions=True)
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        assert len(sampler.calls) == 5 and len(refused) == 35 and len(session.turns) == 5
        await server.stop()

    run(go())


class CancellableSampler(ScriptedSampler):
    """Samples slowly and records whether it was cancelled."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, ["ok"], delay_s=30)
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def __call__(self, prompt_ids: list[int], max_tokens: int | None, stop: list[str]) -> Any:
        self.started.set()
        try:
            return await super().__call__(prompt_ids, max_tokens, stop)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_an_agent_that_hangs_up_cancels_its_sampling_and_records_no_turn(tokenizer: Any) -> None:
    async def go() -> None:
        sampler = CancellableSampler(tokenizer)
        server = await _server(tokenizer, sampler)
        session = server.open(contextvars.copy_context(), max_requests=8)
        async with aiohttp.ClientSession() as http:
            post = asyncio.create_task(http.post(f"{session.base_url}/chat/completions",
                                                 json={"model": "x", "messages": HELLO}))
            await asyncio.wait_for(sampler.started.wait(), 30)
            post.cancel()  # the client closes its connection mid-request
        await asyncio.wait_for(sampler.cancelled.wait(), 30)
        assert not session.turns and not session.tasks
        await server.stop()

    run(go())


def test_a_request_waiting_for_the_slot_has_not_read_its_body(tokenizer: Any) -> None:
    async def go() -> None:
        sampler = CancellableSampler(tokenizer)
        server = await _server(tokenizer, sampler)
        session = server.open(contextvars.copy_context(), max_requests=64)
        reads: list[int] = []

        def reader(i: int) -> Any:
            async def read() -> bytes:
                reads.append(i)
                return b'{"model": "x", "messages": [{"role": "user", "content": "Hi."}]}'
            return read

        calls = [asyncio.create_task(server.chat(None, f"Bearer {session.secret}", reader(i))) for i in range(20)]
        await asyncio.wait_for(sampler.started.wait(), 30)
        await asyncio.sleep(0.2)  # every other request is now waiting for the rollout's one slot
        assert reads == [0], "only the request holding the slot has read its body"
        server.close(session)
        await asyncio.gather(*calls)
        assert not session.turns
        await server.stop()

    run(go())


def test_a_refused_request_leaves_no_renderer_behind(tokenizer: Any) -> None:
    async def go() -> None:
        server = await _server(tokenizer, ScriptedSampler(tokenizer, ["ok"]), max_model_len=256)
        session = server.open(contextvars.copy_context(), max_requests=64)
        async with _client(session) as client:
            for i in range(20):  # each with its own tool set, each too long for the server
                tool = {"type": "function", "function": {**INCREMENT["function"], "name": f"tool_{i}"}}
                with pytest.raises(openai.BadRequestError, match="max_model_len"):
                    await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "w " * 400}],
                                                         tools=[tool])
            assert not session.renderers and session.requests == 0
            for i in range(5):  # accepted tool sets: only the last two renderers are kept
                tool = {"type": "function", "function": {**INCREMENT["function"], "name": f"kept_{i}"}}
                await client.chat.completions.create(model="x", messages=HELLO, tools=[tool])
            assert len(session.renderers) == 2
        await server.stop()

    run(go())


def test_rendering_a_huge_request_does_not_stall_the_loop(tokenizer: Any) -> None:
    async def go() -> None:
        server = await _server(tokenizer, ScriptedSampler(tokenizer, ["ok"]), max_request_bytes=8 * 2**20,
                               max_model_len=1024)
        session = server.open(contextvars.copy_context(), max_requests=8)
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "count the words " * 450_000}]})
        async with aiohttp.ClientSession() as http:  # the body encoded up front: the server's work is measured
            tick = asyncio.create_task(ticker())
            async with http.post(f"{session.base_url}/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"}) as response:
                assert response.status == 400 and "max_model_len" in (await response.json())["error"]["message"]
        done.set()
        await tick
        print(f"7.2 MB request: longest loop stall {max(gaps):.3f} s over {len(gaps)} ticks")
        assert max(gaps) < 3.0, f"the loop stalled {max(gaps):.2f} s"  # 13.2 s when rendering ran on the loop
        await server.stop()

    run(go())


def test_a_tool_whose_name_is_not_a_string_is_refused_before_sampling(tokenizer: Any) -> None:
    async def go() -> None:
        sampler = ScriptedSampler(tokenizer, ["ok"])
        server = await _server(tokenizer, sampler)
        session = server.open(contextvars.copy_context(), max_requests=8)
        bad = {"type": "function", "function": {**INCREMENT["function"], "name": ["increment"]}}
        async with _client(session) as client:
            with pytest.raises(openai.BadRequestError, match="tools must be a list"):
                await client.chat.completions.create(model="x", messages=HELLO, tools=[bad])  # type: ignore[list-item]
        assert not sampler.calls and not session.turns
        await server.stop()

    run(go())
