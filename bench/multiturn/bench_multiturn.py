"""Multi-turn agent rollouts against the env server: rollouts/s and sampler idle time.

Command (repository root, after ``make setup``)::

    .venv/bin/python bench/multiturn/bench_multiturn.py [--concurrency 64 512] [--seconds 40] [--tool-ms 50]

A warm-started tiny model (it calls tools) is served by the real vLLM CPU server; the environment
is ``slow_counter_env:SlowCounterEnv`` (``IncrementEnv`` whose tool sleeps ``--tool-ms`` on the
server's loop, a simulated tool latency), hosted by ``toolgym serve`` in its own process. The
rollout loop's own multi-turn ``generate_one`` runs ``concurrency`` rollouts at a time for
``--seconds``. Printed per concurrency: finished rollouts/s, turns and tool calls per rollout, and
the fraction of wall time the sampler was idle (vLLM ``num_requests_running == 0`` in 0.1 s polls)
while rollouts waited for tools.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from transformers import AutoTokenizer

from sdk import remote_factory
from trainer.concurrency import AdaptiveCap
from trainer.config import AsyncGRPOConfig
from trainer.rollout_loop import AsyncRolloutLoop
from trainer.sampler_client import SamplerClient
from trainer.tiny_model import build_tiny_model
from trainer.vllm_server import VLLMServer, VLLMServerConfig, free_port
from trainer.warm_start import WarmStartConfig, warm_start
from trainer.worker import WorkerChannels

HERE = Path(__file__).resolve().parent


def start_envserver(tool_ms: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "SLOW_COUNTER_MS": str(tool_ms)}
    proc = subprocess.Popen([sys.executable, "-m", "sdk.cli", "serve", "slow_counter_env:SlowCounterEnv",
                             "--port", str(port), "--max-sessions", "2048"], env=env, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("env server did not start")


async def measure(loop: AsyncRolloutLoop, concurrency: int, seconds: float) -> dict[str, float]:
    loop.cap = AdaptiveCap(concurrency, None, loop.max_model_len)
    finished: list[tuple[int, int]] = []
    idle = busy = 0
    deadline = time.monotonic() + seconds

    async def worker(i: int) -> None:
        while time.monotonic() < deadline:
            _, rollout, _ = await loop._one_rollout({"target": 1 + i % 6}, i)
            finished.append((len(rollout.turns), rollout.tool_call_count))

    async def poll() -> None:
        nonlocal idle, busy
        async with SamplerClient(loop.config.vllm_server_base_url) as client:
            while time.monotonic() < deadline:
                load = await client.load()
                if load is not None:
                    idle += load.running == 0
                    busy += 1
                await asyncio.sleep(0.1)

    t0 = time.monotonic()
    await asyncio.gather(poll(), *(worker(i) for i in range(concurrency)))
    elapsed = time.monotonic() - t0
    n = max(len(finished), 1)
    return {"rollouts_per_s": len(finished) / elapsed, "turns": sum(t for t, _ in finished) / n,
            "tool_calls": sum(c for _, c in finished) / n, "sampler_idle_frac": idle / max(busy, 1)}


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--tool-ms", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        warm_start(model_dir, WarmStartConfig(task="counter", steps_per_task=150))
        envserver, env_url = start_envserver(args.tool_ms)
        try:
            with VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024, kv_cache_gib=2)) as server:
                tokenizer = AutoTokenizer.from_pretrained(model_dir)
                rows = []
                for concurrency in args.concurrency:
                    config = AsyncGRPOConfig(output_dir=tmp, vllm_server_base_url=server.base_url,
                                             max_completion_length=48, max_tool_calling_iterations=6,
                                             max_concurrent_rollouts=concurrency, report_to="none", use_cpu=True)
                    channels = WorkerChannels.create(mp.get_context("spawn"), 0, 0)
                    loop = AsyncRolloutLoop(
                        config=config, model_name=str(model_dir), dataset=None, reward_funcs=[],
                        processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id], channels=channels,
                        environment_factory=remote_factory(env_url, "SlowCounterEnv"), max_model_len=1024)

                    async def run() -> dict[str, float]:
                        try:
                            return await measure(loop, concurrency, args.seconds)
                        finally:
                            await loop.sampler.close()
                            await loop.envs.aclose()

                    rows.append((concurrency, asyncio.run(run())))
        finally:
            envserver.terminate()
            envserver.wait(10)
        shutil.rmtree(model_dir, ignore_errors=True)
    print(f"tool latency {args.tool_ms} ms, {args.seconds:.0f} s per point")
    print(f"{'concurrent':>10} {'rollouts/s':>11} {'turns':>6} {'tool calls':>10} {'sampler idle':>12}")
    for concurrency, r in rows:
        print(f"{concurrency:>10} {r['rollouts_per_s']:>11.1f} {r['turns']:>6.2f} {r['tool_calls']:>10.2f} "
              f"{r['sampler_idle_frac']:>12.1%}")


if __name__ == "__main__":
    main()
