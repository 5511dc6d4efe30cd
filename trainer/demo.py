"""``toolgym demo`` (``make demo``): an agent that visibly learns, offline, on this machine.

1. Builds (or reuses, under ``.cache/``) the tiny model and warm-starts it on counter transcripts,
   so it emits well-formed ``increment`` tool calls but reaches the target only part of the time.
2. Starts the env server (``toolgym serve environments.counter:IncrementEnv``) and the real vLLM
   CPU server on the warm model, and shows one sampled turn with its log-probs.
3. Measures the success rate on fresh evaluation episodes (sampled at temperature 1, never
   trained on) through those servers.
4. Trains with ``AsyncGRPOTrainer`` against the *remote* environment (spawned rollout worker,
   weight syncs into the server every step), with a progress table.
5. Measures the success rate again and prints the before/after table and the plots.

Every process it starts is stopped when it returns::

    toolgym demo [--cache .cache] [--steps 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

TARGETS = (1, 2, 3, 4, 5, 6)
EVAL_EPISODES_PER_TARGET = 24


def warm_model(cache: Path, seed: int) -> Path:
    """The warm-started tiny model, built once and reused from ``cache``."""
    from trainer.tiny_model import build_tiny_model
    from trainer.warm_start import WarmStartConfig, warm_start

    model_dir = cache / f"warm-counter-seed{seed}"
    done = model_dir / ".warm-start-done"
    if not done.exists():
        t0 = time.monotonic()
        build_tiny_model(model_dir, seed=seed)
        warm_start(model_dir, WarmStartConfig(task="counter", seed=seed, steps_per_task=300))
        done.write_text("ok\n")
        print(f"built and warm-started the tiny model in {time.monotonic() - t0:.0f} s -> {model_dir}")
    return model_dir


async def _show_turn(base_url: str, tokenizer: Any) -> None:
    from environments.counter import IncrementEnv
    from sdk import environment_tools
    from trainer.chat_template import render_prompt_ids
    from trainer.sampler_client import SamplerClient, SamplingParams

    env = IncrementEnv()
    tools = [t.schema for t in environment_tools(env)]
    prompt = render_prompt_ids(tokenizer, [{"role": "user", "content": env.reset(target=3)}], tools)
    async with SamplerClient(base_url) as client:
        turn = await client.complete(prompt, SamplingParams(max_tokens=40, logprobs=3), seed=0)
    print(f"\nprompt ends with: ...{tokenizer.decode(prompt[-12:])!r}")
    print(f"sampled turn:      {tokenizer.decode(turn.output_ids)!r}")
    print("first tokens with their log-probs and the sampler's top-3:")
    for token, lp, top in list(zip(turn.output_ids, turn.output_log_probs, turn.output_sampler_logprobs or []))[:8]:
        cands = "  ".join(f"{tokenizer.decode([t])!r} {v:.2f}" for t, v in top.items())
        print(f"  {tokenizer.decode([token])!r:>14} {lp:7.3f}   {cands}")


def main(argv: list[str]) -> int:
    """Run the demo; returns the exit status."""
    parser = argparse.ArgumentParser(prog="toolgym demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=".cache", help="where the warm-started model is built and reused")
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps of the training run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="outputs/demo", help="checkpoint-free run folder (plots, logs)")
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from sdk import remote_factory
    from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
    from trainer.evaluation import evaluate_policy
    from trainer.reporting import PlotCallback, ProgressCallback
    from trainer.train_cli import serve_environment
    from trainer.vllm_server import VLLMServer, VLLMServerConfig

    torch.set_num_threads(1)  # tiny matrices: one thread beats two on a 2-core machine shared with vLLM
    t0 = time.monotonic()
    model_dir = warm_model(Path(args.cache), args.seed)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with serve_environment("environments.counter:IncrementEnv") as env_url, \
            VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024,
                                        log_path=str(Path(args.output_dir) / "vllm.log"))) as server:
        print(f"env server at {env_url}; vLLM CPU server ready at {server.base_url} in {server.ready_s:.0f} s")
        asyncio.run(_show_turn(server.base_url, tokenizer))
        factory = remote_factory(env_url, "IncrementEnv")
        held_out = [{"target": t} for t in TARGETS]
        before = evaluate_policy(server.base_url, str(model_dir), factory, held_out,
                                 samples_per_row=EVAL_EPISODES_PER_TARGET)
        print(f"\nsuccess before training: {before.success_rate:.1%} ({before.episodes} fresh episodes)\n")

        dataset = Dataset.from_dict({"target": [t for t in TARGETS for _ in range(16)]})
        config = AsyncGRPOConfig(
            output_dir=args.output_dir, vllm_server_base_url=server.base_url, max_steps=args.steps,
            num_generations=8, max_completion_length=48, max_tool_calling_iterations=8, learning_rate=2e-4,
            gradient_accumulation_steps=4,
            use_cpu=True, gradient_checkpointing=False, save_strategy="no", report_to="tensorboard",
            disable_tqdm=True, seed=args.seed, max_staleness=2)
        plots = PlotCallback()
        trainer = AsyncGRPOTrainer(model=str(model_dir), args=config, train_dataset=dataset,
                                   processing_class=tokenizer, environment_factory=factory,
                                   callbacks=[ProgressCallback(), plots])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        after = evaluate_policy(server.base_url, str(model_dir), factory, held_out,
                                samples_per_row=EVAL_EPISODES_PER_TARGET)

    print(f"\n{'':28}{'before':>10}{'after':>10}")
    print(f"{'success rate (fresh episodes)':28}{before.success_rate:>10.1%}{after.success_rate:>10.1%}")
    print(f"{'tool calls per episode':28}{before.tool_calls_per_episode:>10.2f}{after.tool_calls_per_episode:>10.2f}")
    print(f"{'failed tool calls':28}{before.failed_tool_call_frac:>10.1%}{after.failed_tool_call_frac:>10.1%}")
    for path in plots.written:
        print(f"plot: {path}")
    print(f"\ndemo finished in {time.monotonic() - t0:.0f} s; every process it started is stopped")
    return 0
