"""``toolgym demo`` (``make demo``): the main job on an embedded default, offline, on this machine.

It builds (or reuses, under ``.cache/``) the tiny local model, starts the real vLLM CPU server on
it, shows one sampled completion with its per-token log-probs and top candidates, then trains the
model for a few steps with the asynchronous GRPO trainer against that server (real rollout worker,
real weight syncs) and prints what changed. Every process it starts is stopped when it returns.

    toolgym demo [--cache DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from trainer.sampler_client import SamplerClient, SamplingParams
from trainer.vllm_server import VLLMServer, VLLMServerConfig


def _answer_length_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Demo reward: prefer answers of about 8 tokens (shows the policy moving quickly)."""
    return [-abs(len(ids) - 8) / 8 for ids in completion_ids]


async def _show_sample(base_url: str, tokenizer: Any) -> None:
    from trainer.chat_template import render_prompt_ids

    prompt = render_prompt_ids(tokenizer, [{"role": "user", "content": "Increment the counter to 3."}])
    async with SamplerClient(base_url) as client:
        turn = await client.complete(prompt, SamplingParams(max_tokens=24, logprobs=3), seed=0)
    print(f"prompt ({len(prompt)} tokens): {tokenizer.decode(prompt)!r}")
    print(f"completion: {tokenizer.decode(turn.output_ids)!r}  (finish: {turn.finish_reason})")
    print(f"{'token':>16}  {'logprob':>8}  top-3 candidates")
    for token, lp, top in zip(turn.output_ids, turn.output_log_probs, turn.output_sampler_logprobs or []):
        cands = ", ".join(f"{tokenizer.decode([t])!r}:{v:.2f}" for t, v in top.items())
        print(f"{tokenizer.decode([token])!r:>16}  {lp:8.3f}  {cands}")


def main(argv: list[str]) -> int:
    """Run the demo; returns the exit status."""
    parser = argparse.ArgumentParser(prog="toolgym demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=".cache", help="where the tiny model is built and reused")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of the training run")
    args = parser.parse_args(argv)

    from datasets import Dataset
    from transformers import AutoTokenizer

    from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
    from trainer.tiny_model import build_tiny_model

    t0 = time.monotonic()
    model_dir = Path(args.cache) / "tiny-model"
    if not (model_dir / "model.safetensors").exists():
        build_tiny_model(model_dir, seed=0)
        print(f"built the tiny model in {model_dir} ({time.monotonic() - t0:.1f} s)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=512)) as server:
        print(f"vLLM CPU server ready at {server.base_url} in {server.ready_s:.1f} s")
        asyncio.run(_show_sample(server.base_url, tokenizer))
        dataset = Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 33)]})
        with tempfile.TemporaryDirectory() as out:
            config = AsyncGRPOConfig(
                output_dir=out, vllm_server_base_url=server.base_url, max_steps=args.steps, num_generations=8,
                max_completion_length=24, learning_rate=3e-4, use_cpu=True, gradient_checkpointing=False,
                save_strategy="no", report_to="none", disable_tqdm=True)
            trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=_answer_length_reward, args=config,
                                       train_dataset=dataset, processing_class=tokenizer)
            trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        print(f"\n{'step':>4} {'reward':>8} {'len':>6} {'policy':>6} {'sync_s':>7} {'gen tok/s':>9}")
        for h in logs:
            print(f"{h['step']:>4} {h.get('reward', float('nan')):8.3f} {h.get('completions/mean_length', 0):6.1f} "
                  f"{h['step']:>6} {h.get('perf/weight_sync_s', 0):7.2f} "
                  f"{h.get('rollout/generated_tokens_per_s', 0):9.0f}")
    print(f"\ndemo finished in {time.monotonic() - t0:.0f} s; every process it started is stopped")
    return 0
