"""Seed sweep of the end-to-end learning run (the experiment ``tests/e2e/test_learning.py`` asserts on).

For each trainer seed: put the warm-started model's weights back on the server, evaluate fresh counter
episodes through the env server and the vLLM server, train with the remote environment, evaluate again.
Prints one row per seed and the distribution of the gain; ``--json`` writes the rows too, and each
seed's log history is written to ``<output-dir>/seed<N>/log_history.json``::

    .venv/bin/python bench/e2e/learning_sweep.py --seeds 0 1 2 3 --steps 20 --episodes-per-target 12

The defaults are the test's settings. The warm model is built (or reused) under ``--cache``, exactly
as ``make demo`` builds it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from sdk import remote_factory
from toolgym.kit.counter_experiment import counter_config, learning_run, serve_policy, warm_model
from toolgym.launch.envserver import EnvServerProcess
from toolgym.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.reporting import ProgressCallback

TEST_STEPS = 15
TEST_EPISODES_PER_TARGET = 12


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
    print(f"\nsteps {args.steps}, {rows[0]['episodes']} evaluation episodes before and after, seeds {args.seeds}")
    for key in ("before", "after"):
        print(f"{key + ':':8}" + ", ".join(f"{r[key]:.1%}" for r in rows))
    print(f"gain:   min {min(gains):+.1%}  mean {statistics.mean(gains):+.1%}  max {max(gains):+.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
