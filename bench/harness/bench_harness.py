"""Harness mode against the built-in loop: the same counter task, servers and concurrency.

Command (repository root, after ``make setup``)::

    .venv/bin/python bench/harness/bench_harness.py [--concurrency 32] [--seconds 40] [--tool-ms 50] \\
        [--repeats 2] [--cache .cache]

The warm-started counter model of ``make demo`` (built under ``--cache`` when missing) is served by
the real vLLM CPU server; the environment is ``bench/multiturn``'s ``SlowCounterEnv`` (its tool
sleeps ``--tool-ms``) on ``toolgym serve``. Two arms run ``--concurrency`` rollouts at a time for
``--seconds`` each, alternating ``--repeats`` times on the same servers:

* ``built-in``: ``AsyncRolloutLoop``'s own multi-turn ``generate_one``;
* ``harness``: ``HarnessRolloutLoop`` running ``counter_agent.counter_agent``, an ``openai``-client
  agent doing the same episode through the rollout's capture endpoint (one ``AsyncOpenAI`` client,
  one HTTP hop and one JSON round trip per request more).

Printed per run, and the harness / built-in ratio of the medians: finished rollouts/s, generated
tokens/s (the issue's target: harness >= 0.9x built-in), turns and tool calls per rollout, the
sampler's idle fraction (``idle (client)``: wall time with no sampling request in flight;
``idle (server)``: 0.1 s polls of vLLM's ``/metrics`` reading no running request) and this
process's CPU per rollout, and the machine's 1-minute load average at the end of the run. Both
arms share the measurement code of ``bench/multiturn``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "multiturn")]

from bench_multiturn import TimedLoop, measure, start_envserver  # noqa: E402
from counter_agent import MAX_TOOL_CALLING_ITERATIONS, counter_agent  # noqa: E402

from sdk import remote_factory  # noqa: E402
from toolgym.kit.counter_experiment import warm_model  # noqa: E402
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig  # noqa: E402
from trainer.rollout.harness_loop import HarnessRolloutLoop, HarnessSettings  # noqa: E402
from trainer.rollout.settings import RolloutSettings  # noqa: E402


class TimedHarnessLoop(TimedLoop, HarnessRolloutLoop):
    """The harness loop with the built-in arm's in-flight clock around every sampling request."""


def one_arm(arm: str, base_url: str, model_dir: Path, env_url: str, concurrency: int,
            seconds: float) -> dict[str, float]:
    """Measure one arm on fresh loop objects (the same servers)."""
    settings = RolloutSettings.from_server(base_url, str(model_dir), max_completion_length=48,
                                           max_tool_calling_iterations=MAX_TOOL_CALLING_ITERATIONS,
                                           max_concurrent_rollouts=concurrency)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    factory = remote_factory(env_url, "SlowCounterEnv")
    loop = (TimedHarnessLoop(settings, tokenizer, environment_factory=factory, agent=counter_agent,
                             harness=HarnessSettings(agent_timeout=120))
            if arm == "harness" else TimedLoop(settings, tokenizer, environment_factory=factory))

    async def run() -> dict[str, float]:
        await loop.setup()
        try:
            return await measure(loop, concurrency, seconds)
        finally:
            await loop.sampler.close()
            await loop.envs.aclose()
            await loop.close()

    result = asyncio.run(run())
    result["load_1m"] = os.getloadavg()[0]
    return result


def main() -> None:
    """Measure both arms and print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--tool-ms", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path(".cache"), help="where the warm model is built / reused")
    args = parser.parse_args()
    model_dir = warm_model(args.cache, seed=0)
    rows: list[tuple[str, dict[str, float]]] = []
    envserver = start_envserver(args.tool_ms)
    try:
        with VLLMServer(VLLMServerConfig(
                model=str(model_dir), max_model_len=1024, kv_cache_gib=2, ready_timeout_s=1200)) as server:
            for _ in range(args.repeats):
                for arm in ("built-in", "harness"):
                    rows.append((arm, one_arm(arm, server.base_url, model_dir, envserver.url, args.concurrency,
                                              args.seconds)))
    finally:
        envserver.stop()
    print(f"{args.concurrency} rollouts in flight, tool latency {args.tool_ms} ms, {args.seconds:.0f} s per run")
    header = (f"{'arm':>9} {'rollouts/s':>11} {'gen tok/s':>10} {'turns':>6} {'tool calls':>10} "
              f"{'idle (client)':>13} {'idle (server)':>13} {'CPU ms/rollout':>14} {'load 1m':>7}")
    print(header)
    for arm, r in rows:
        print(f"{arm:>9} {r['rollouts_per_s']:>11.2f} {r['generated_tokens_per_s']:>10.0f} {r['turns']:>6.2f} "
              f"{r['tool_calls']:>10.2f} {r['client_idle_frac']:>13.1%} {r['server_idle_frac']:>13.1%} "
              f"{r['cpu_ms_per_rollout']:>14.1f} {r['load_1m']:>7.2f}")

    def median(arm: str, key: str) -> float:
        return statistics.median(r[key] for a, r in rows if a == arm)

    for key, label in (("rollouts_per_s", "rollouts/s"), ("generated_tokens_per_s", "generated tokens/s"),
                       ("cpu_ms_per_rollout", "CPU ms/rollout")):
        print(f"harness / built-in, {label} (medians): {median('harness', key) / median('built-in', key):.2f}x")


if __name__ == "__main__":
    main()
