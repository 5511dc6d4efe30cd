"""Many short rollouts at high concurrency: stale drops, sync pause, trainer idle, generated tokens/s.

The workload of issue 20, as a user runs it: the tiny arithmetic model (warm-started to answer
``What is a + b?`` in ``\\boxed{}``), the real vLLM CPU server, ``AsyncGRPOTrainer`` with a reward
function and dataset of one's own, defaults otherwise (8 generations, ``max_staleness=4``, the
adaptive concurrency cap up to 512 rollouts), 24-token completions. Each pipeline setting trains
``--steps`` steps from the same warm weights against the same server; the settings alternate for
``--rounds`` rounds so that the machine's drifting load hits each of them. Compared:

* ``trl``: TRL AsyncGRPOTrainer's pipeline (``staleness_allowance="consumed"``: the allowance is
  ``max_staleness`` steps of tokens, counted when the trainer takes a group off the queue;
  ``weight_sync_pause="reset"``: ``/pause?mode=keep`` clearing the KV cache, which preempts every
  running request);
* ``keep``: the defaults with ``weight_sync_pause="keep"``: the sync pauses the server without
  clearing its KV cache (this project's default before the whole-update sync);
* ``default``: this project's defaults (see ``docs/pipeline.md``: the sync is one engine call,
  with no pause);
* ``cap64``: the defaults with ``max_concurrent_rollouts=64``: fewer requests in flight when a
  sync comes (``--settings trl,keep,default,cap64``).

Printed per run and as medians per setting, from the trainer's logs, after the first
``--skip`` steps (start-up): stale drops / samples that reached the trainer, sum of
``perf/weight_sync_pause_s`` / sum of ``perf/step_s`` (and the same for the whole sync,
``perf/weight_sync_s``, and for the time the training loop blocked on it,
``perf/weight_sync_wait_s``), sum of ``perf/rollout_wait_s`` / sum of ``perf/step_s`` (trainer
idle), generated tokens/s, seconds per step, mean staleness, rollouts in
flight, vLLM preemptions, and the machine's 1-minute load average at the run's end.

Command (repository root, after ``make setup``)::

    .venv/bin/python bench/pipeline/bench_short_rollouts.py [--steps 30] [--rounds 1] \\
        [--settings trl,keep,default,cap64] [--token-budget 256] [--torch-threads 1] [--model DIR]

``--token-budget 256`` makes a step take fewer samples than the server generates meanwhile (the
regime where the queue fills to the allowance, as in issue 20); the figures measured with it are
in ``docs/pipeline.md``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

from datasets import Dataset

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig

COMPLETION_TOKENS = 24
SETTINGS: dict[str, dict[str, Any]] = {
    "trl": {"staleness_allowance": "consumed", "weight_sync_pause": "reset"},
    "keep": {"weight_sync_pause": "keep"},
    "default": {},
    "cap64": {"max_concurrent_rollouts": 64},
}
_BOXED = re.compile(r"\\boxed\{([^}]*)\}")


def boxed_answer_reward(completions: list[list[dict[str, str]]], answer: list[str], **kwargs: Any) -> list[float]:
    """1 when the completion's ``\\boxed{}`` holds the dataset's ``answer``, else 0."""
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        found = _BOXED.findall(completion[-1]["content"])
        out.append(float(bool(found) and found[-1].strip() == expected))
    return out


def arithmetic_dataset(n: int = 2048, seed: int = 0, high: int = 9) -> Dataset:
    """``n`` prompts ``What is a + b?`` with the sum in an ``answer`` column."""
    from toolgym.kit.warm_start import arithmetic_prompt

    rng = random.Random(seed)
    pairs = [(rng.randint(0, high), rng.randint(0, high)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": arithmetic_prompt(a, b)}] for a, b in pairs],
                              "answer": [str(a + b) for a, b in pairs]})


def run_setting(name: str, model_dir: Path, base_url: str, out: Path, args: argparse.Namespace) -> dict[str, float]:
    """Train ``steps`` steps with setting ``name``; the run's figures."""
    from toolgym.kit.counter_experiment import serve_policy

    serve_policy(base_url, model_dir)  # every run starts from the warm weights
    config = AsyncGRPOConfig(
        output_dir=str(out), vllm_server_base_url=base_url, max_steps=args.steps, token_budget=args.token_budget,
        max_completion_length=COMPLETION_TOKENS,
        learning_rate=1e-5, use_cpu=True, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        **SETTINGS[name])
    trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=boxed_answer_reward, args=config,
                               train_dataset=arithmetic_dataset())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "perf/step_s" in h][args.skip:]

    def total(key: str) -> float:
        return sum(h.get(key, 0.0) or 0.0 for h in logs)

    def mean(key: str) -> float:
        values = [h[key] for h in logs if key in h and h[key] == h[key]]
        return statistics.fmean(values) if values else float("nan")

    step_s = total("perf/step_s")
    received = total("sample/received_count")
    return {
        "stale_frac": total("sample/dropped_stale_count") / received if received else float("nan"),
        "pause_frac": total("perf/weight_sync_pause_s") / step_s,
        "sync_frac": total("perf/weight_sync_s") / step_s,
        "sync_wait_frac": total("perf/weight_sync_wait_s") / step_s,
        "idle_frac": total("perf/rollout_wait_s") / step_s,
        "tokens_per_s": sum(h.get("rollout/generated_tokens_per_s", 0.0) * h["perf/step_s"] for h in logs) / step_s,
        "s_per_step": step_s / len(logs),
        "staleness": mean("sample/staleness_mean"),
        "in_flight": mean("rollout/concurrency"),
        "preemptions": total("rollout/vllm_preemption_count"),
        "received": received,
        "load": os.getloadavg()[0],
    }


def describe(name: str, r: dict[str, float]) -> str:
    """One run's figures as a line."""
    return (f"{name:>8}: stale drops {r['stale_frac']:6.1%} of {r['received']:.0f} samples, sync pause "
            f"{r['pause_frac']:6.1%} of step time (whole sync {r['sync_frac']:5.1%}, trainer blocked on it "
            f"{r['sync_wait_frac']:5.1%}), trainer idle {r['idle_frac']:6.1%}, generated "
            f"{r['tokens_per_s']:6,.0f} tok/s, {r['s_per_step']:.2f} s/step, staleness {r['staleness']:.2f}, "
            f"in flight {r['in_flight']:.0f}, preemptions {r['preemptions']:.0f}, load {r['load']:.1f}")


def main() -> None:
    """Run the settings and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=3, help="start-up steps left out of the figures")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--settings", default="trl,default")
    parser.add_argument("--token-budget", type=int, default=None,
                        help="forwarded tokens per row (the step's size); default: the server's max_model_len")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="the trainer's torch threads; 0 leaves torch's default, as a user's script does")
    parser.add_argument("--model", type=Path, default=None,
                        help="a warm-started arithmetic model (toolgym tiny-model OUT --warm-start arithmetic); "
                             "built in a temporary directory when omitted")
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {sorted(SETTINGS)}")

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from toolgym.kit.tiny_model import build_tiny_model
            from toolgym.kit.warm_start import WarmStartConfig, warm_start

            model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
            warm_start(model_dir, WarmStartConfig(task="arithmetic"))
        results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        with VLLMServer(VLLMServerConfig(model=str(model_dir))) as server:
            for i in range(args.rounds):
                for name in names:
                    r = run_setting(name, Path(model_dir), server.base_url, Path(tmp) / f"{name}-{i}", args)
                    results[name].append(r)
                    print(f"round {i + 1} {describe(name, r)}", flush=True)
    print(f"\nmedians over {args.rounds} round(s), steps {args.skip + 1}-{args.steps}:")
    for name in names:
        print(describe(name, {k: statistics.median(r[k] for r in results[name]) for k in results[name][0]}))


if __name__ == "__main__":
    main()
