"""Wall time to reach a held-out success rate on the counter task: asynchronous vs synchronous.

One env server (counter environment) and one vLLM CPU server serve both runs, which start from the
same warm-started weights (pushed back onto the server before each run) with the same seeds and
settings (the demo's, see ``toolgym.kit.counter_experiment.counter_config``); only ``max_staleness`` differs:

* asynchronous: ``max_staleness=4`` (generation runs up to 4 steps ahead of training);
* synchronous: ``max_staleness=0`` (one step's worth of generation, then training, then the sync).

Success is measured on held-out, fresh episodes through the same servers, not with the training
reward: every ``--every`` optimizer steps a callback copies the policy's weights and notes the wall
time since the start of training (the copy takes milliseconds, so it does not disturb the run).
After the run each snapshot is pushed onto the server and evaluated, so evaluation costs no
training time. The figure is the first snapshot time at which success reaches ``--target``.
The mean training reward of the same window of steps is printed beside it.

    .venv/bin/python bench/e2e/bench_e2e.py [--steps 30] [--every 5] [--target 0.45] [--episodes-per-target 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from sdk import remote_factory
from toolgym.kit.counter_experiment import (
    counter_config,
    counter_trainer,
    evaluate_counter,
    serve_policy,
    warm_model,
)
from trainer.launch.envserver import EnvServerProcess
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig

SCHEDULES = (("asynchronous", 4), ("synchronous", 0))


class Snapshots(TrainerCallback):
    """Copies the policy's weights every ``every`` optimizer steps, with the wall time since training began."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.taken: list[tuple[int, float, list[tuple[str, Any]]]] = []
        self.started = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.started = time.monotonic()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if state.global_step % self.every == 0:
            weights = [(n, p.detach().clone()) for n, p in model.named_parameters()]
            self.taken.append((state.global_step, time.monotonic() - self.started, weights))


def run_schedule(name: str, staleness: int, model_dir: Path, base_url: str, factory: Any,
                 args: argparse.Namespace) -> list[dict[str, float]]:
    """Train once with ``max_staleness=staleness``; evaluate its snapshots; one dict per snapshot."""
    from trainer.reporting import ProgressCallback

    serve_policy(base_url, model_dir)
    config = counter_config(Path(args.output_dir) / name, base_url, args.steps, args.seed, max_staleness=staleness)
    snapshots = Snapshots(args.every)
    trainer = counter_trainer(model_dir, factory, config, callbacks=[snapshots, ProgressCallback()])
    trainer.train()
    rewards = {int(h["step"]): h["reward"] for h in trainer.state.log_history if "reward" in h and "loss" in h}
    points = []
    for step, elapsed, weights in snapshots.taken:
        serve_policy(base_url, model_dir, version=step, weights=weights)
        held_out = evaluate_counter(base_url, model_dir, factory, args.episodes_per_target)
        window = [rewards[s] for s in range(step - args.every + 1, step + 1) if s in rewards]
        points.append({"step": step, "elapsed_s": elapsed, "success": held_out.success_rate,
                       "train_reward": statistics.mean(window) if window else float("nan")})
        print(f"  {name:>12} step {step:3d}  {elapsed:6.0f} s  held-out success {held_out.success_rate:6.1%}"
              f"  training reward (last {args.every} steps) {points[-1]['train_reward']:.3f}", flush=True)
    return points


def main() -> None:
    """Run both schedules and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="snapshot (and evaluate) every this many steps")
    parser.add_argument("--target", type=float, default=0.45, help="held-out success rate to reach")
    parser.add_argument("--episodes-per-target", type=int, default=16, help="held-out episodes per counter target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=".cache")
    parser.add_argument("--output-dir", default="outputs/bench-e2e")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    model_dir = warm_model(Path(args.cache), seed=0)
    with EnvServerProcess(["environments.counter:IncrementEnv"]) as env_server, \
            VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024)) as server:
        factory = remote_factory(env_server.url, "IncrementEnv")
        serve_policy(server.base_url, model_dir)
        start = evaluate_counter(server.base_url, model_dir, factory, args.episodes_per_target)
        print(f"warm policy: held-out success {start.success_rate:.1%} ({start.episodes} episodes)", flush=True)
        results = {name: run_schedule(name, staleness, model_dir, server.base_url, factory, args)
                   for name, staleness in SCHEDULES}

    print(f"\ntarget: held-out success >= {args.target:.0%} (start {start.success_rate:.1%}); "
          f"{args.steps} steps, snapshots every {args.every}, {start.episodes} episodes per evaluation")
    print(f"{'schedule':>14} {'max_staleness':>13} {'s/step':>7} {'time to target':>15} {'final success':>14}")
    for name, staleness in SCHEDULES:
        points = results[name]
        reached = next((p for p in points if p["success"] >= args.target), None)
        to_target = f"{reached['elapsed_s']:.0f} s (step {reached['step']:.0f})" if reached else "not reached"
        per_step = points[-1]["elapsed_s"] / points[-1]["step"]
        print(f"{name:>14} {staleness:>13} {per_step:>7.1f} {to_target:>15} {points[-1]['success']:>14.1%}")


if __name__ == "__main__":
    main()
