"""Multi-turn agent rollouts against the env server: rollouts/s and sampler idle time.

Command (repository root, after ``make setup``)::

    .venv/bin/python bench/multiturn/bench_multiturn.py [--concurrency 64 512] [--seconds 40] [--tool-ms 50] \\
        [--profile DIR] [--ab]

A warm-started tiny model (it calls tools) is served by the real vLLM CPU server; the environment
is ``slow_counter_env:SlowCounterEnv`` (``IncrementEnv`` whose tool sleeps ``--tool-ms`` on the
server's loop, a simulated tool latency), hosted by ``toolgym serve`` in its own process. The
rollout loop's own multi-turn ``generate_one`` runs ``concurrency`` rollouts at a time for
``--seconds``. Printed per concurrency: finished rollouts/s, turns and tool calls per rollout, and
the fraction of wall time the sampler was idle, measured two ways:

* ``idle (client)``: the share of wall time during which this process had no sampling request in
  flight (exact: it is the only client of the server, so the server had nothing to run);
* ``idle (server)``: the share of 0.1 s polls of vLLM's ``/metrics`` reading
  ``num_requests_running == 0`` (polled from the same event loop, so a blocked loop delays polls).

``loop lag`` is the share of wall time the event loop was late to wake a probe task that sleeps
5 ms: the loop running code, or the process waiting for a CPU (on a loaded machine mostly the
latter); near 100 % the loop, not the sampler or the tools, is the bottleneck. ``CPU ms/rollout``
is this process's CPU time per finished rollout (the rollout loop's own work: rendering,
tokenizing, HTTP, parsing); other load on the machine moves it too, but less than wall time.
``--profile DIR`` also writes a cProfile of each point to ``DIR/multiturn_<concurrency>_<0|1>.prof``
and prints its top functions. ``--ab`` runs every point twice on the same servers, tokenizing every
prompt in full and then only what each turn added (the default), one right after the other.

Measured with ``--ab`` on the 2-core CPU machine while other jobs ran four more vLLM servers (load
average 20-27): wall-clock figures moved with that load from point to point, so compare the two
arms of a point, CPU per rollout first::

    concurrent    tokenize  rollouts/s  turns tool calls idle (client) idle (server) loop lag CPU ms/rollout
            64        full         2.3   2.73       1.73          0.7%         47.4%    14.7%           15.7
            64 incremental         4.9   2.66       1.66          0.7%          7.9%    38.8%            9.8
           512        full         5.6   2.71       1.71          2.4%         61.5%    22.9%           11.3
           512 incremental         9.5   2.71       1.71          3.8%         38.7%    36.6%            8.8

The sampler is almost never waiting for tools (``idle (client)`` 1-4 %: some request is always in
flight). The engine's own gauge reads 0 running far more often: the requests are then still in
vLLM's API-server process or waiting for a CPU, not for this loop, which uses under 10 % of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp
from transformers import AutoTokenizer

from sdk import remote_factory
from toolgym.kit.tiny_model import build_tiny_model
from toolgym.kit.warm_start import WarmStartConfig, warm_start
from trainer.launch.envserver import EnvServerProcess
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.records import TurnRecord
from trainer.rollout.concurrency import AdaptiveCap
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.settings import RolloutSettings
from trainer.vllm.client import SamplingParams

HERE = Path(__file__).resolve().parent


def start_envserver(tool_ms: int) -> EnvServerProcess:
    env = {"PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "SLOW_COUNTER_MS": str(tool_ms)}
    return EnvServerProcess(["slow_counter_env:SlowCounterEnv"], args=["--max_sessions", "2048"], env=env).start()


class TimedLoop(AsyncRolloutLoop):
    """The default loop, timing when no sampling request is in flight (the sampler has nothing to do)."""

    def start_clock(self) -> None:
        """Start counting idle time now."""
        self.in_flight = 0
        self.generated_tokens = 0
        self.idle_s = 0.0
        self.idle_since: float | None = time.monotonic()

    def stop_clock(self) -> float:
        """Stop counting; returns the idle seconds since :meth:`start_clock`."""
        if self.idle_since is not None:
            self.idle_s += time.monotonic() - self.idle_since
            self.idle_since = None
        return self.idle_s

    async def generate_one_turn(self, prompt_ids: list[int], params: SamplingParams | None = None) -> TurnRecord:
        """The default request, with the in-flight count around it (and its generated tokens counted)."""
        if self.in_flight == 0 and self.idle_since is not None:
            self.idle_s += time.monotonic() - self.idle_since
        self.in_flight += 1
        try:
            turn = await super().generate_one_turn(prompt_ids, params)
            self.generated_tokens += len(turn.output_ids)
            return turn
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle_since = time.monotonic()


async def measure(loop: TimedLoop, concurrency: int, seconds: float) -> dict[str, float]:
    loop.scheduler.cap = AdaptiveCap(concurrency, None, loop.settings.server.max_model_len)
    finished: list[tuple[int, int]] = []
    idle = polls = 0
    late_s = 0.0
    deadline = time.monotonic() + seconds

    async def worker(i: int) -> None:
        while time.monotonic() < deadline:
            _, rollout, _ = await loop.scheduler.one_rollout({"target": 1 + i % 6}, i)
            finished.append((len(rollout.turns), rollout.tool_call_count))

    async def poll() -> None:
        nonlocal idle, polls
        # Reads the one gauge it needs (parsing all of vLLM's /metrics takes ~10 ms of this loop).
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                async with session.get(f"{loop.settings.vllm_server_base_url}/metrics") as r:
                    text = await r.text()
                running = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith("vllm:num_requests_running")]
                idle += sum(running) == 0
                polls += 1
                await asyncio.sleep(0.1)

    async def probe() -> None:
        nonlocal late_s
        while time.monotonic() < deadline:
            t = time.monotonic()
            await asyncio.sleep(0.005)
            late_s += max(time.monotonic() - t - 0.005, 0.0)

    t0, cpu0 = time.monotonic(), time.process_time()
    loop.start_clock()
    await asyncio.gather(poll(), probe(), *(worker(i) for i in range(concurrency)))
    elapsed, cpu_s = time.monotonic() - t0, time.process_time() - cpu0
    client_idle_s = loop.stop_clock()
    n = max(len(finished), 1)
    return {"rollouts_per_s": len(finished) / elapsed, "turns": sum(t for t, _ in finished) / n,
            "tool_calls": sum(c for _, c in finished) / n, "client_idle_frac": client_idle_s / elapsed,
            "generated_tokens_per_s": loop.generated_tokens / elapsed,
            "server_idle_frac": idle / max(polls, 1), "loop_lag_frac": min(late_s / elapsed, 1.0),
            "cpu_ms_per_rollout": 1000 * cpu_s / n}


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--tool-ms", type=int, default=50)
    parser.add_argument("--profile", type=Path, default=None, help="write a cProfile per point into this folder")
    parser.add_argument("--ab", action="store_true", help="each point with full, then incremental tokenization")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        warm_start(model_dir, WarmStartConfig(task="counter", steps_per_task=150))
        envserver = start_envserver(args.tool_ms)
        env_url = envserver.url
        try:
            with VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024, kv_cache_gib=2,
                                               ready_timeout_s=1200)) as server:
                tokenizer = AutoTokenizer.from_pretrained(model_dir)
                rows = []
                modes = [False, True] if args.ab else [True]
                for concurrency, incremental in [(c, m) for c in args.concurrency for m in modes]:
                    settings = RolloutSettings.from_server(
                        server.base_url, str(model_dir), max_completion_length=48, max_tool_calling_iterations=6,
                        max_concurrent_rollouts=concurrency)
                    loop = TimedLoop(settings, tokenizer,
                                     environment_factory=remote_factory(env_url, "SlowCounterEnv"))
                    if not incremental:
                        loop._incremental_render = False

                    async def run(loop: TimedLoop, concurrency: int) -> dict[str, float]:
                        try:
                            return await measure(loop, concurrency, args.seconds)
                        finally:
                            await loop.sampler.close()
                            await loop.envs.aclose()

                    profiler = cProfile.Profile() if args.profile else None
                    if profiler is not None:
                        profiler.enable()
                    rows.append((concurrency, incremental, asyncio.run(run(loop, concurrency))))
                    if profiler is not None:
                        profiler.disable()
                        args.profile.mkdir(parents=True, exist_ok=True)
                        profiler.dump_stats(args.profile / f"multiturn_{concurrency}_{int(incremental)}.prof")
                        print(f"--- profile, {concurrency} concurrent, incremental={incremental} (top by own time)")
                        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        finally:
            envserver.stop()
        shutil.rmtree(model_dir, ignore_errors=True)
    print(f"tool latency {args.tool_ms} ms, {args.seconds:.0f} s per point")
    print(f"{'concurrent':>10} {'tokenize':>11} {'rollouts/s':>11} {'turns':>6} {'tool calls':>10} "
          f"{'idle (client)':>13} {'idle (server)':>13} {'loop lag':>9} {'CPU ms/rollout':>14}")
    for concurrency, incremental, r in rows:
        mode = "incremental" if incremental else "full"
        print(f"{concurrency:>10} {mode:>11} {r['rollouts_per_s']:>11.1f} {r['turns']:>6.2f} {r['tool_calls']:>10.2f} "
              f"{r['client_idle_frac']:>13.1%} {r['server_idle_frac']:>13.1%} {r['loop_lag_frac']:>9.1%} "
              f"{r['cpu_ms_per_rollout']:>14.1f}")


if __name__ == "__main__":
    main()
