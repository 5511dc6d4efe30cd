"""The asynchronous pipeline on the real vLLM CPU server: worker throughput and trainer idle time.

Command (repository root, after ``make setup``)::

    .venv/bin/python bench/pipeline/bench_pipeline.py [--concurrency 32] [--seconds 20] [--warmup 10] [--rounds 3] [--steps 8]

Prints, measured in the same run against the same server:

1. generated tokens/s of raw requests at ``--concurrency`` (our sampler client, no worker, the
   same prompts), and of the rollout worker process (``AsyncRolloutLoop``: prompts rendered with
   the chat template, groups of 8, scoring, queueing) at the same concurrency cap, with a consumer
   that drains the queue instantly; the ratio is the worker's overhead (target >= 0.9x). Both
   count the tokens of completions that finish inside a steady-state window of ``--seconds``
   after ``--warmup`` seconds of ramp-up (for the worker, counted from its first group: the first
   group runs alone). The two alternate for ``--rounds`` windows, so a change in the machine's
   load hits both; the medians are compared;
2. the trainer's idle fraction, sum(``perf/rollout_wait_s``) / sum(``perf/step_s``), over the same
   number of steps with ``max_staleness=4`` and with ``max_staleness=0``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from datasets import Dataset

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.rollout_loop import AsyncRolloutLoop
from trainer.sampler_client import SamplerClient, SamplingParams
from trainer.tiny_model import build_tiny_model
from trainer.vllm_server import VLLMServer, VLLMServerConfig
from trainer.worker import RolloutWorker, WorkerChannels, spawn_context

MAX_TOKENS = 64


def spread_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Distinct rewards within a group, so every group is queued (none dropped)."""
    return [float(i) for i in range(len(completion_ids))]


def prompts(n: int = 256) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Increment the counter to {i % 9 + 1}."}]
                                         for i in range(n)]})


async def raw_tokens_per_s(base_url: str, prompt_ids: list[list[int]], concurrency: int, warmup: float,
                           seconds: float) -> float:
    """Closed loop of ``concurrency`` clients; completion tokens finished per second in the window
    ``[warmup, warmup + seconds]`` after the start (requests in flight at its end still finish)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=8)
    tokens = 0
    sent = 0
    async with SamplerClient(base_url, max_connections=concurrency) as client:
        await client.limits()
        start = time.monotonic()
        window = (start + warmup, start + warmup + seconds)

        async def loop() -> None:
            nonlocal tokens, sent
            while time.monotonic() < window[1]:
                sent += 1
                turn = await client.complete(prompt_ids[sent // 8 % len(prompt_ids)], params)
                if window[0] <= time.monotonic() <= window[1]:
                    tokens += len(turn.output_ids)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return tokens / seconds


def worker_tokens_per_s(config: AsyncGRPOConfig, model_dir: Path, tokenizer: Any, warmup: float,
                        seconds: float) -> float:
    """Run the real worker process with an instant consumer; completion tokens queued per second in
    the window ``[warmup, warmup + seconds]`` after its first group arrived (the first group runs
    alone: the worker knows no group size before it, SPEC §2)."""
    ctx = spawn_context()
    channels = WorkerChannels.create(ctx, initial_allowance=10**12, initial_version=0)
    kwargs = dict(config=config, model_name=str(model_dir), dataset=prompts(), reward_funcs=[spread_reward],
                  processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id], max_model_len=1024,
                  kv_cache_tokens=None)
    worker = RolloutWorker(AsyncRolloutLoop, kwargs, channels, timeout_s=120, ctx=ctx)
    worker.start()
    try:
        first = worker.get(timeout_s=120)  # wait for the worker to be up and producing
        assert first is not None
        tokens, start = 0, time.monotonic()
        while time.monotonic() < start + warmup + seconds:
            group = worker.get(timeout_s=0.2)
            if group is not None and time.monotonic() >= start + warmup:
                tokens += sum(s.sequence.num_trained for s in group.samples)
        return tokens / seconds
    finally:
        worker.stop()


def idle_fraction(server: VLLMServer, model_dir: Path, out: str, steps: int, max_staleness: int) -> tuple[float, float]:
    """(idle fraction, seconds per step) of a short training run."""
    config = AsyncGRPOConfig(
        output_dir=out, vllm_server_base_url=server.base_url, max_steps=steps, num_generations=8,
        max_completion_length=MAX_TOKENS, max_staleness=max_staleness, learning_rate=1e-5, use_cpu=True,
        gradient_checkpointing=False, save_strategy="no", report_to="none", disable_tqdm=True, token_budget=1024)
    trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=spread_reward, args=config, train_dataset=prompts())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "perf/step_s" in h][1:]  # the first step includes start-up
    wait = sum(h["perf/rollout_wait_s"] for h in logs)
    step = sum(h["perf/step_s"] for h in logs)
    return wait / step, step / len(logs)


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before each window (ramp-up)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per idle run; 0 skips that part")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from trainer.chat_template import render_prompt_ids

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024)) as server:
            prompt_ids = [render_prompt_ids(tokenizer, row["prompt"]) for row in prompts(9)]
            config = AsyncGRPOConfig(
                output_dir=str(Path(tmp) / "w"), vllm_server_base_url=server.base_url, num_generations=8,
                max_completion_length=MAX_TOKENS, max_concurrent_rollouts=args.concurrency, report_to="none",
                use_cpu=True)
            raws, workers = [], []
            for i in range(args.rounds):
                raws.append(asyncio.run(raw_tokens_per_s(server.base_url, prompt_ids, args.concurrency, args.warmup,
                                                         args.seconds)))
                workers.append(worker_tokens_per_s(config, model_dir, tokenizer, args.warmup, args.seconds))
                print(f"round {i + 1}: raw {raws[-1]:,.0f} tok/s, worker {workers[-1]:,.0f} tok/s", flush=True)
            raw, via_worker = statistics.median(raws), statistics.median(workers)
            if args.steps:
                idle4, step4 = idle_fraction(server, model_dir, str(Path(tmp) / "s4"), args.steps, 4)
                idle0, step0 = idle_fraction(server, model_dir, str(Path(tmp) / "s0"), args.steps, 0)
    print(f"generated tokens/s @ {args.concurrency} (median of {args.rounds}): raw {raw:,.0f}, through the rollout "
          f"worker {via_worker:,.0f} ({via_worker / raw:.2f}x)")
    if not args.steps:
        return
    print(f"trainer idle fraction over {args.steps - 1} steps: max_staleness=4 {idle4:.1%} ({step4:.1f} s/step), "
          f"max_staleness=0 {idle0:.1%} ({step0:.1f} s/step)")


if __name__ == "__main__":
    main()
