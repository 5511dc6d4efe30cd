"""vLLM CPU server on the tiny model: readiness time, generation throughput, weight-update time.

Command (from the repository root, after ``make setup``)::

    .venv/bin/python bench/vllm_cpu/bench_sampler.py [--concurrency 32] [--requests 256] [--max-tokens 128]

Prints: seconds to readiness; generated tokens/s at the given concurrency through our
:class:`~trainer.vllm.client.SamplerClient`; the time of one full weight update through the backend
the server runs (``toolgym_shm`` on CPU: the whole update in one call, ``weight_sync_pause="none"``,
then a prefix-cache reset), median of 5.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from toolgym.kit.tiny_model import build_tiny_model
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.sync import weight_synchronizer
from trainer.vllm.client import SamplerClient, SamplingParams


async def generated_tokens_per_s(base_url: str, concurrency: int, requests: int, max_tokens: int) -> tuple[float, int]:
    """Run ``requests`` completions, ``concurrency`` at a time; returns (tokens/s, tokens)."""
    params = SamplingParams(max_tokens=max_tokens, logprobs=8)
    gate = asyncio.Semaphore(concurrency)
    async with SamplerClient(base_url, max_connections=concurrency) as client:
        async def one(i: int) -> int:
            async with gate:
                turn = await client.complete([5, 17, 42, 99, 7, i % 50 + 3], params)
                return len(turn.output_ids)

        await asyncio.gather(*(one(i) for i in range(concurrency)))  # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(requests)))
        elapsed = time.perf_counter() - t0
    return sum(counts) / elapsed, sum(counts)


def main() -> None:
    """Build the tiny model, start the server, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        with VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024)) as server:
            tps, tokens = asyncio.run(
                generated_tokens_per_s(server.base_url, args.concurrency, args.requests, args.max_tokens)
            )
            sync = weight_synchronizer(server.base_url, model_dir)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            n_params = sum(p.numel() for p in model.parameters())
            totals = [sync.sync(model.named_parameters(), version=v).total_s for v in range(1, 6)]
        print(f"vLLM readiness:            {server.ready_s:.1f} s")
        print(f"generated tokens/s @ {args.concurrency:>3}:   {tps:,.0f}  ({tokens} tokens, {args.requests} requests)")
        print(f"weight update ({n_params / 1e6:.2f}M params): {statistics.median(totals) * 1000:.1f} ms median of 5")


if __name__ == "__main__":
    main()
