"""``toolgym demo`` (``make demo``): an agent that visibly learns, offline, on this machine.

1. Builds (or reuses, under ``.cache/``) the tiny model and warm-starts it on counter transcripts,
   so it emits well-formed ``increment`` tool calls but reaches the target only part of the time.
2. Starts the env server (``toolgym serve environments.counter:IncrementEnv``) and the real vLLM
   CPU server on the warm model, and shows one sampled turn with its log-probs.
3. Measures the success rate on fresh evaluation episodes (sampled at temperature 1, never
   trained on) through those servers with ``toolgym eval`` (its table, and its files in
   ``<output_dir>/eval-before``; the command is printed, to run again by hand).
4. Trains with ``AsyncGRPOTrainer`` against the *remote* environment (spawned rollout worker,
   weight syncs into the server every step), with a progress table. The reward is the
   environment's plus a penalty for failed tool calls (:func:`trainer.rewards.tool_error_penalty`).
5. Measures the success rate again (``<output_dir>/eval-after``) and prints the before/after table,
   ``toolgym eval --compare``'s difference with its interval and test, and the plots.

Every process it starts is stopped when it returns::

    toolgym demo [--cache .cache] [--steps 15] [--seed 0] [--family qwen3]

``--family`` builds the tiny model in another model family's chat format (``qwen3_5``: Qwen3.5's XML
tool calls; any name of :func:`trainer.families.families`), so the same demo shows that family learning.

The experiment's building blocks live in :mod:`toolgym.kit.counter_experiment`, shared with the
end-to-end tests (``tests/e2e``) and the benchmarks (``bench/e2e``), so all three run the same experiment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import time
from pathlib import Path
from typing import Any

from toolgym.cli import eval as eval_cli
from toolgym.kit.counter_experiment import counter_config, counter_eval_argv, counter_trainer, warm_model
from trainer.families import families
from trainer.rollout.eval_results import EvalSummary


async def _show_turn(base_url: str, tokenizer: Any) -> None:
    from environments.counter import IncrementEnv
    from sdk import environment_tools
    from trainer.rollout.chat_template import render_prompt_ids
    from trainer.vllm.client import SamplerClient, SamplingParams

    env = IncrementEnv()
    tools = [t.schema for t in environment_tools(env)]
    prompt = render_prompt_ids(tokenizer, [{"role": "user", "content": env.reset(target=3)}], tools)
    async with SamplerClient(base_url) as client:
        turn = await client.complete(prompt, SamplingParams(max_tokens=40, logprobs=3), seed=0)
    print(f"\nprompt ends with: ...{tokenizer.decode(prompt[-12:])!r}")
    print(f"sampled turn:      {tokenizer.decode(turn.output_ids)!r}")
    print("first tokens with their log-probs and the sampler's top-3:")
    tops = turn.output_sampler_logprobs or []  # none: nothing to show
    for token, lp, top in list(zip(turn.output_ids, turn.output_log_probs, tops, strict=False))[:8]:
        cands = "  ".join(f"{tokenizer.decode([t])!r} {v:.2f}" for t, v in top.items())
        print(f"  {tokenizer.decode([token])!r:>14} {lp:7.3f}   {cands}")


def _evaluate(argv: list[str]) -> EvalSummary | None:
    """``toolgym eval`` with ``argv``, its command printed first; ``None`` when Ctrl-C stopped it."""
    print(f"\n$ toolgym eval {shlex.join(argv)}")
    summary, interrupted = eval_cli.evaluate(eval_cli.parse_args(argv))
    return None if interrupted else summary


def main(argv: list[str]) -> int:
    """Run the demo; returns the exit status."""
    parser = argparse.ArgumentParser(prog="toolgym demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=".cache", help="where the warm-started model is built and reused")
    parser.add_argument("--steps", type=int, default=15, help="optimizer steps of the training run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", default="qwen3", choices=[f.name for f in families()],
                        help="the model family whose chat template and tool-call format the tiny model uses")
    parser.add_argument("--output_dir", "--output-dir", default="outputs/demo",
                        help="checkpoint-free run folder (plots, logs)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from sdk import remote_factory
    from trainer.launch.envserver import EnvServerProcess
    from trainer.launch.threads import trainer_threads_beside_vllm
    from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig

    torch.set_num_threads(trainer_threads_beside_vllm(os.cpu_count() or 1))
    t0 = time.monotonic()
    model_dir = warm_model(Path(args.cache), args.seed, family=args.family)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    with EnvServerProcess(["environments.counter:IncrementEnv"]) as env_server, \
            VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024,
                                        log_path=str(Path(args.output_dir) / "vllm.log"))) as server:
        env_url = env_server.url
        print(f"env server at {env_url}; vLLM CPU server ready at {server.base_url} in {server.ready_s:.0f} s")
        asyncio.run(_show_turn(server.base_url, AutoTokenizer.from_pretrained(model_dir)))
        out = Path(args.output_dir)

        def eval_argv(folder: str) -> list[str]:
            return counter_eval_argv(server.base_url, model_dir, f"{env_url}/IncrementEnv", out / folder)

        before = _evaluate(eval_argv("eval-before"))
        if before is None:
            return 130
        print(f"\nsuccess before training: {before.success_rate.value:.1%} ({before.episodes} fresh episodes)\n")
        config = counter_config(args.output_dir, server.base_url, args.steps, args.seed, report_to="tensorboard")
        trainer = counter_trainer(model_dir, remote_factory(env_url, "IncrementEnv"), config)  # table, plots
        trainer.train()
        after = _evaluate(eval_argv("eval-after"))
        if after is None:
            return 130

    print(f"\n{'':28}{'before':>10}{'after':>10}")
    print(f"{'success rate (fresh episodes)':28}{before.success_rate.value:>10.1%}{after.success_rate.value:>10.1%}")
    print(f"{'tool calls per episode':28}{before.tool_calls_per_episode:>10.2f}{after.tool_calls_per_episode:>10.2f}")
    print(f"{'failed tool calls':28}{before.failed_tool_call_frac:>10.1%}{after.failed_tool_call_frac:>10.1%}")
    compare = ["--compare", str(out / "eval-before"), str(out / "eval-after")]
    print(f"\n$ toolgym eval {shlex.join(compare)}")
    eval_cli.main(compare)
    print(f"\ndemo finished in {time.monotonic() - t0:.0f} s; every process it started is stopped")
    return 0
