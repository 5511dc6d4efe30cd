"""What an evaluation during training costs the training run: the demo's run with and without evaluations.

One vLLM CPU server on the warm counter model serves both runs, which start from the same weights
(pushed back before each run), seeds and settings (``counter_config``, the counter environment in
process). The second run evaluates every ``--eval-every`` steps on ``--episodes`` episodes (the six
targets, repeated, ``eval_num_generations`` episodes each): the rollout worker runs them beside
training's rollouts while the training loop waits for their result. The cost per evaluation is the
difference of the two runs' ``train()`` wall times over the number of evaluations; ``eval_runtime``
(the wait) and the mean ``perf/step_s`` of each run are printed beside it.

    .venv/bin/python bench/e2e/bench_eval_cost.py [--steps 8] [--eval-every 4] [--episodes 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoTokenizer
from transformers.trainer_callback import PrinterCallback

from environments.counter import IncrementEnv
from toolgym.kit.counter_experiment import TARGETS, counter_config, counter_dataset, serve_policy, warm_model
from trainer.async_grpo_trainer import AsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.rewards import tool_error_penalty

GENERATIONS = 8


def _run(model_dir: Path, base_url: str, output_dir: Path, steps: int, **eval_fields: Any) -> dict[str, Any]:
    serve_policy(base_url, model_dir)
    config = counter_config(output_dir, base_url, steps, **eval_fields)
    rows = eval_fields.get("eval_num_rows") or 1
    trainer = AsyncGRPOTrainer(
        model=str(model_dir), args=config, train_dataset=counter_dataset(), reward_funcs=tool_error_penalty,
        eval_dataset=Dataset.from_dict({"target": [TARGETS[i % len(TARGETS)] for i in range(rows)]}),
        processing_class=AutoTokenizer.from_pretrained(model_dir), environment_factory=IncrementEnv)
    trainer.remove_callback(PrinterCallback)
    t0 = time.monotonic()
    trainer.train()
    history = trainer.state.log_history
    return {"train_s": time.monotonic() - t0,
            "step_s": statistics.mean(h["perf/step_s"] for h in history if "perf/step_s" in h),
            "evals": [h["eval_runtime"] for h in history if "eval_runtime" in h],
            "success": [h["eval_success_rate"] for h in history if "eval_success_rate" in h]}


def main() -> None:
    """Run both and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--cache", default=".cache")
    parser.add_argument("--output-dir", default="outputs/bench-eval-cost")
    args = parser.parse_args()
    model_dir = warm_model(Path(args.cache), seed=0)
    out = Path(args.output_dir)
    with VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024)) as server:
        plain = _run(model_dir, server.base_url, out / "plain", args.steps)
        evaluated = _run(model_dir, server.base_url, out / "evaluated", args.steps, eval_strategy="steps",
                         eval_steps=args.eval_every, eval_num_rows=args.episodes // GENERATIONS,
                         eval_num_generations=GENERATIONS)
    evals = evaluated["evals"]
    print(f"{args.steps} steps; {len(evals)} evaluations of {args.episodes // GENERATIONS * GENERATIONS} episodes")
    print(f"train() without evaluation {plain['train_s']:.0f} s, mean step {plain['step_s']:.1f} s")
    print(f"train() with evaluation    {evaluated['train_s']:.0f} s, mean step {evaluated['step_s']:.1f} s")
    runtimes = ", ".join(f"{s:.1f}" for s in evals)
    successes = ", ".join(f"{v:.0%}" for v in evaluated["success"])
    print(f"cost per evaluation {(evaluated['train_s'] - plain['train_s']) / max(len(evals), 1):.1f} s; "
          f"eval_runtime {runtimes} s; success {successes}")


if __name__ == "__main__":
    main()
