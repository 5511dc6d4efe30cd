"""Seed sweep of the end-to-end learning run (the experiment ``tests/e2e/test_learning.py`` asserts on).

For each trainer seed: put the warm-started model's weights back on the server, evaluate fresh counter
episodes through the env server and the vLLM server, train with the remote environment, evaluate again.
Prints one row per seed, then a markdown table with each seed's gain and its one-sided p-value (a
two-proportion z-test: did the success rate rise beyond the evaluations' sampling noise?) and the
median gain; ``--json`` writes the rows too, and each seed's log history is written to
``<output-dir>/seed<N>/log_history.json``. The sweep of ``bench/e2e/README.md`` (8 trainer seeds,
144 evaluation episodes a side), and its long run (4x the demo's steps)::

    .venv/bin/python bench/e2e/learning_sweep.py --seeds 0 1 2 3 4 5 6 7 --episodes-per-target 24
    .venv/bin/python bench/e2e/learning_sweep.py --seeds 0 --steps 60 --episodes-per-target 24

The defaults are the test's settings. The warm model is built (or reused) under ``--cache``, exactly
as ``make demo`` builds it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from sdk import remote_factory
from toolgym.kit.counter_experiment import counter_config, learning_run, serve_policy, warm_model
from trainer.launch.envserver import EnvServerProcess
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.reporting import ProgressCallback

TEST_STEPS = 15
TEST_EPISODES_PER_TARGET = 12


def gain_p_value(before: float, after: float, episodes: int) -> float:
    """One-sided p-value of ``after > before`` for two success rates of ``episodes`` episodes each
    (two-proportion z-test, pooled variance)."""
    pooled = (before + after) / 2
    standard_error = math.sqrt(2 * pooled * (1 - pooled) / episodes)
    if standard_error == 0:
        return 0.5
    return 0.5 * math.erfc((after - before) / standard_error / math.sqrt(2))


def main() -> None:
    """Run the sweep and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=TEST_STEPS)
    parser.add_argument("--episodes-per-target", type=int, default=TEST_EPISODES_PER_TARGET)
    parser.add_argument("--learning-rate", type=float,
                        help="default: the demo's (toolgym.kit.counter_experiment.counter_config)")
    parser.add_argument("--cache", default=".cache")
    parser.add_argument("--output-dir", default="outputs/learning-sweep")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    model_dir = warm_model(Path(args.cache), seed=0)
    rows = []
    with EnvServerProcess(["environments.counter:IncrementEnv"]) as env_server, \
            VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024)) as server:
        factory = remote_factory(env_server.url, "IncrementEnv")
        for seed in args.seeds:
            serve_policy(server.base_url, model_dir)
            overrides = {} if args.learning_rate is None else {"learning_rate": args.learning_rate}
            config = counter_config(Path(args.output_dir) / f"seed{seed}", server.base_url, args.steps, seed,
                                    **overrides)
            t0 = time.monotonic()
            run = learning_run(model_dir, factory, config, episodes_per_target=args.episodes_per_target,
                               callbacks=[ProgressCallback()])
            row = {"seed": seed, "before": run.before.success_rate, "after": run.after.success_rate,
                   "episodes": run.after.episodes, "train_s": round(run.train_s, 1),
                   "total_s": round(time.monotonic() - t0, 1)}
            rows.append(row)
            (Path(config.output_dir) / "log_history.json").write_text(json.dumps(run.log_history, indent=0))
            print(f"seed {seed}: success {row['before']:.1%} -> {row['after']:.1%} "
                  f"(+{row['after'] - row['before']:.1%}), train {row['train_s']:.0f} s, "
                  f"with evaluations {row['total_s']:.0f} s", flush=True)
    gains = [r["after"] - r["before"] for r in rows]
    print(f"\nsteps {args.steps}, {rows[0]['episodes']} evaluation episodes before and after, seeds {args.seeds}\n")
    print("| trainer seed | success before | success after | gain | p (one-sided) | train time |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        r["p"] = gain_p_value(r["before"], r["after"], r["episodes"])
        print(f"| {r['seed']} | {r['before']:.1%} | {r['after']:.1%} | {r['after'] - r['before']:+.1%} | "
              f"{r['p']:.2g} | {r['train_s']:.0f} s |")
    print(f"\ngain: min {min(gains):+.1%}, median {statistics.median(gains):+.1%}, mean {statistics.mean(gains):+.1%}, "
          f"max {max(gains):+.1%}; seeds below their start: {sum(g < 0 for g in gains)}; "
          f"seeds with p < 0.05: {sum(r['p'] < 0.05 for r in rows)} of {len(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
