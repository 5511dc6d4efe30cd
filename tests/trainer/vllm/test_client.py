"""The sampler client against a real HTTP server (aiohttp) that speaks the vLLM routes it uses."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from aiohttp import web

from trainer.vllm.client import SamplerClient, SamplingParams

METRICS = 'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:num_requests_running{engine="0"} 3\n'


class FakeVLLM:
    """``/v1/models``, ``/metrics`` and ``/v1/completions``; a completion can be held open."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.holding = asyncio.Event()
        self.drop_next = False

    async def models(self, request: web.Request) -> web.Response:
        self.hits["models"] += 1
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 1024}]})

    async def metrics(self, request: web.Request) -> web.Response:
        self.hits["metrics"] += 1
        return web.Response(text=METRICS)

    async def completions(self, request: web.Request) -> web.Response:
        self.hits["completions"] += 1
        self.bodies.append(await request.json())
        if self.drop_next:  # close the connection without answering, as a server closing keep-alive does
            self.drop_next = False
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if not self.hold.is_set():
            self.holding.set()
            await self.hold.wait()
        return web.json_response({"choices": [{"token_ids": [5, 6], "finish_reason": "stop", "logprobs": {
            "token_logprobs": [-0.1, -0.2], "top_logprobs": [{"token_id:5": -0.1}, {"token_id:6": -0.2}]}}]})

    async def start(self) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.add_routes([web.get("/v1/models", self.models), web.get("/metrics", self.metrics),
                        web.post("/v1/completions", self.completions)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        return runner, f"http://127.0.0.1:{port}"


PARAMS = SamplingParams(max_tokens=4, logprobs=1)


def test_request_seeds_follow_the_client_seed():
    async def seeds(seed: int) -> list[int]:
        server = FakeVLLM()
        runner, url = await server.start()
        try:
            async with SamplerClient(url, seed=seed) as client:
                for _ in range(3):
                    await client.complete([1, 2], PARAMS)
        finally:
            await runner.cleanup()
        return [b["seed"] for b in server.bodies]

    first, again, other = asyncio.run(seeds(7)), asyncio.run(seeds(7)), asyncio.run(seeds(8))
    assert first == again
    assert first != other
    assert len(set(first)) == 3  # still a fresh seed per request


def test_complete_names_the_given_model_and_reads_nothing_else():
    """The client reads neither ``/v1/models`` nor ``/metrics`` to complete: what the server is was read
    once at start (``trainer.vllm.server_info``) and handed to it."""
    async def scenario(model: str | None) -> tuple[Counter[str], list[str | None]]:
        server = FakeVLLM()
        runner, url = await server.start()
        try:
            async with SamplerClient(url, model=model) as client:
                for _ in range(3):
                    await client.complete([1], PARAMS)
                await client.complete([1], PARAMS, model="adapter-v1")
        finally:
            await runner.cleanup()
        return server.hits, [b.get("model") for b in server.bodies]

    hits, models = asyncio.run(scenario("tiny"))
    assert hits == Counter(completions=4)
    assert models == ["tiny", "tiny", "tiny", "adapter-v1"]
    hits, models = asyncio.run(scenario(None))  # no name: vLLM serves its base model
    assert hits == Counter(completions=4)
    assert models == [None, None, None, "adapter-v1"]


def test_metrics_poll_does_not_wait_for_a_completion_connection():
    """With every completion connection busy, ``/metrics`` still answers: it has its own pool."""
    async def scenario() -> tuple[float | None, bool]:
        server = FakeVLLM()
        runner, url = await server.start()
        try:
            async with SamplerClient(url, max_connections=1, model="tiny") as client:
                server.hold.clear()
                pending = asyncio.create_task(client.complete([1], PARAMS))
                await server.holding.wait()  # the only completion connection is taken
                load = await asyncio.wait_for(client.load(), 30)  # before the fix: waits forever
                still_running = not pending.done()
                server.hold.set()
                await pending
        finally:
            await runner.cleanup()
        return (load.running if load else None), still_running

    running, still_running = asyncio.run(scenario())
    assert running == 3
    assert still_running


def test_a_connection_closed_under_a_request_is_retried_at_once() -> None:
    async def go() -> None:
        server = FakeVLLM()
        runner, url = await server.start()
        server.drop_next = True
        try:
            async with SamplerClient(url, backoff_s=60.0) as client:  # a backed-off retry would hit the timeout
                turn = await asyncio.wait_for(client.complete([1, 2], PARAMS), timeout=20)
            assert turn.output_ids == [5, 6]
            assert client.retry_count == 1 and server.hits["completions"] == 2
        finally:
            await runner.cleanup()

    asyncio.run(go())
