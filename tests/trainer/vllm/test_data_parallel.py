"""vLLM's data-parallel engines behind one URL (``vllm serve --data-parallel-size 2``) on the CPU build: the
trainer's view of such a server is one server whose ``/metrics`` it sums over engines, whose engines each get
every request's own seed, and whose weight sync (one call) reaches every engine.

A real ``vllm serve`` process with two engine cores of the tiny model; nothing else.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolgym.kit.tiny_model import build_tiny_model
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.sync import push_weights
from trainer.vllm.client import SamplerClient, SamplingParams
from trainer.vllm.prometheus import parse_prometheus

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

PROMPT = [5, 17, 42]
REQUESTS = 16


def _top1_logprobs(base_url: str) -> tuple[set[float], set[tuple[int, ...]]]:
    """Over ``REQUESTS`` concurrent requests of the same prompt: the top-1 log-prob at the first position (fixed
    by the weights, whatever the seed) and the sampled outputs."""
    async def run() -> list[tuple[float, tuple[int, ...]]]:
        async with SamplerClient(base_url, seed=0) as client:
            turns = await asyncio.gather(*(client.complete(PROMPT, SamplingParams(max_tokens=8, logprobs=1))
                                           for _ in range(REQUESTS)))
        return [(round(max((t.output_sampler_logprobs or [{}])[0].values()), 4), tuple(t.output_ids)) for t in turns]

    results = asyncio.run(run())
    return {lp for lp, _ in results}, {ids for _, ids in results}


def _requests_per_engine(base_url: str, wait_s: float = 30.0) -> dict[str, float]:
    """Requests finished per engine, from ``/metrics`` once they add up to every request sent (the engines'
    counts reach the API server a few seconds late)."""
    deadline = time.monotonic() + wait_s
    while True:
        text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
        served: dict[str, float] = {}
        for name, labels, value in parse_prometheus(text):
            if name == "vllm:request_success_total":
                served[labels.get("engine", "?")] = served.get(labels.get("engine", "?"), 0.0) + value
        if sum(served.values()) >= REQUESTS or time.monotonic() > deadline:
            return served
        time.sleep(1.0)


def _hf_top1(model_dir: Path) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return round(float(torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1).max()), 4)


def test_two_engines_behind_one_url_take_requests_seeds_and_a_weight_sync(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = VLLMServerConfig(model=str(tiny_model_dir), max_model_len=512,
                              extra_args=["--data-parallel-size", "2"], ready_timeout_s=900)
    with VLLMServer(config) as server:
        top1, outputs = _top1_logprobs(server.base_url)
        assert top1 == {_hf_top1(tiny_model_dir)}
        assert len(outputs) > 1, "each request's own seed: the engines do not decode identical samples"
        served = _requests_per_engine(server.base_url)
        assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), \
            f"both engines take requests, each counted in /metrics (the trainer sums them): {served}"
        other = build_tiny_model(tmp_path / "other", seed=1)
        push_weights(server.base_url, AutoModelForCausalLM.from_pretrained(other).named_parameters(), version=1,
                     model_dir=tiny_model_dir)
        top1, _ = _top1_logprobs(server.base_url)
        assert top1 == {_hf_top1(other)}, "one sync reaches both engines"
