"""The asynchronous pipeline on the real vLLM CPU server: worker throughput and trainer idle time.

Command (repository root, after ``make setup``)::

    .venv/bin/python bench/pipeline/bench_pipeline.py \
        [--concurrency 32] [--seconds 20] [--warmup 10] [--rounds 3] [--steps 8]

Prints, measured in the same run against the same server:

1. generated tokens/s of raw requests at ``--concurrency`` (our sampler client, no worker, the
   same prompts), and of the rollout worker process (``AsyncRolloutLoop``: prompts rendered with
   the chat template, groups of 8, scoring, queueing) at the same concurrency cap, with a consumer
   that drains the queue instantly; the ratio is the worker's overhead (target >= 0.9x). Both
   count the tokens of completions that finish inside a steady-state window of ``--seconds``
   after ``--warmup`` seconds of ramp-up (for the worker, counted from its first group: the first
   group runs alone). The two alternate for ``--rounds`` windows, so a change in the machine's
   load hits both; the medians are compared. Each round also prints the evidence that explains
   a slow window: the machine's load average, the rollouts in flight (time-weighted mean, from
   the client's side), the server's mean running requests (``/metrics`` sampled every 0.5 s),
   the share of the window the client's event-loop thread spent runnable but not running (its
   run-queue delay, ``/proc/.../schedstat``: CPU starvation on a shared machine), and for the
   worker its concurrency cap over the window and its request retries. On a shared machine the
   server's own speed moves with its neighbours' load between two windows; the median ratio of
   the server's running requests (worker window / raw window) is printed too: how well the
   worker keeps the server fed, whatever the server's speed;
2. the trainer's idle fraction, sum(``perf/rollout_wait_s``) / sum(``perf/step_s``), over the same
   number of steps with ``max_staleness=4`` and with ``max_staleness=0``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import Dataset

from toolgym.kit.tiny_model import build_tiny_model
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.rollout.concurrency import AdaptiveCap
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.settings import RolloutSettings
from trainer.rollout.worker import RolloutWorker, WorkerChannels, spawn_context
from trainer.vllm.client import SamplerClient, SamplingParams
from trainer.vllm.prometheus import parse_prometheus, server_load

MAX_TOKENS = 64


def spread_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Distinct rewards within a group, so every group is queued (none dropped)."""
    return [float(i) for i in range(len(completion_ids))]


def prompts(n: int = 256) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Increment the counter to {i % 9 + 1}."}]
                                         for i in range(n)]})


@dataclass
class Window:
    """One steady-state window's throughput and the evidence behind it."""

    tokens_per_s: float
    in_flight: float  # time-weighted mean rollouts (requests) in flight, client side
    server_running: float  # mean of the server's vllm:num_requests_running
    run_queue_frac: float | None  # share of the window the client's loop thread waited for a CPU
    load: float  # 1-minute load average at the window's end
    caps: list[int] = field(default_factory=list)  # the worker's concurrency cap, one per /metrics poll
    retries: int = 0

    def evidence(self) -> str:
        """The window's evidence as one line."""
        starved = "n/a" if self.run_queue_frac is None else f"{self.run_queue_frac:.0%}"
        cap = f", cap {'→'.join(str(c) for c in _runs(self.caps))}" if self.caps else ""
        return (f"in flight {self.in_flight:.1f}{cap}, server running {self.server_running:.1f}, "
                f"loop run-queue delay {starved}, retries {self.retries}, load {self.load:.1f}")


def _runs(values: list[int]) -> list[int]:
    """``values`` without consecutive repeats (a trajectory)."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


class ServerWatch:
    """Samples the server's running/waiting requests every ``period_s`` on a thread."""

    def __init__(self, base_url: str, period_s: float = 0.5) -> None:
        self.base_url = base_url
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []  # (monotonic time, running requests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-watch", daemon=True)

    def __enter__(self) -> ServerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=5) as r:
                    load = server_load(parse_prometheus(r.read().decode()))
            except OSError:
                continue
            self.samples.append((time.monotonic(), load.running))

    def mean_running(self, start: float, end: float) -> float:
        """Mean running requests sampled in ``[start, end]`` (NaN without a sample)."""
        values = [v for t, v in self.samples if start <= t <= end]
        return statistics.fmean(values) if values else float("nan")


def run_queue_s(pid: int, tid: int | None = None) -> float | None:
    """Seconds thread ``tid`` of process ``pid`` (its main thread by default) spent runnable but
    waiting for a CPU, from ``/proc/<pid>/task/<tid>/schedstat``; ``None`` where unavailable."""
    try:
        with open(f"/proc/{pid}/task/{tid or pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _frac(before: float | None, after: float | None, seconds: float) -> float | None:
    return None if before is None or after is None else (after - before) / seconds


async def raw_tokens_per_s(base_url: str, prompt_ids: list[list[int]], concurrency: int, warmup: float,
                           seconds: float, watch: ServerWatch) -> Window:
    """Closed loop of ``concurrency`` clients; completion tokens finished per second in the window
    ``[warmup, warmup + seconds]`` after the start (requests in flight at its end still finish)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=8)
    tokens = 0
    sent = 0
    gate = AdaptiveCap(concurrency, None, 0)  # never waits: counts the requests in flight
    me = threading.get_native_id()
    async with SamplerClient(base_url, max_connections=concurrency, seed=0) as client:
        start = time.monotonic()
        window = (start + warmup, start + warmup + seconds)
        marks: dict[str, Any] = {}

        async def mark() -> None:
            await asyncio.sleep(warmup)
            gate.take_mean_in_flight()
            marks["delay0"] = run_queue_s(os.getpid(), me)
            await asyncio.sleep(window[1] - time.monotonic())
            marks["in_flight"] = gate.take_mean_in_flight()
            marks["delay1"] = run_queue_s(os.getpid(), me)
            marks["load"] = os.getloadavg()[0]

        async def loop() -> None:
            nonlocal tokens, sent
            while time.monotonic() < window[1]:
                sent += 1
                await gate.acquire()
                try:
                    turn = await client.complete(prompt_ids[sent // 8 % len(prompt_ids)], params)
                finally:
                    await gate.release()
                if window[0] <= time.monotonic() <= window[1]:
                    tokens += len(turn.output_ids)

        await asyncio.gather(mark(), *(loop() for _ in range(concurrency)))
        return Window(tokens / seconds, marks["in_flight"], watch.mean_running(*window),
                      _frac(marks["delay0"], marks["delay1"], seconds), marks["load"], retries=client.retry_count)


def worker_tokens_per_s(settings: RolloutSettings, tokenizer: Any, warmup: float, seconds: float,
                        watch: ServerWatch) -> Window:
    """Run the real worker process with an instant consumer; completion tokens queued per second in
    the window ``[warmup, warmup + seconds]`` after its first group arrived (the first group runs
    alone: the worker knows no group size before it, docs/pipeline.md). ``settings`` carry the
    server's ``max_model_len`` and KV-cache tokens, as the trainer's do (the adaptive cap)."""
    ctx = spawn_context()
    channels = WorkerChannels.create(ctx, initial_allowance=10**12, initial_version=0)
    kwargs = dict(processing_class=tokenizer, dataset=prompts(), reward_funcs=[spread_reward])
    worker = RolloutWorker(AsyncRolloutLoop, settings, kwargs, channels, timeout_s=120, ctx=ctx)
    worker.start()
    try:
        first = worker.get(timeout_s=120)  # wait for the worker to be up and producing
        assert first is not None
        tokens, start = 0, time.monotonic()
        window = (start + warmup, start + warmup + seconds)
        in_flight: list[float] = []
        caps: list[int] = []
        retries = 0
        delay0 = None
        while time.monotonic() < window[1]:
            group = worker.get(timeout_s=0.2)
            records = worker.drain_metrics()
            if time.monotonic() < window[0]:
                delay0 = run_queue_s(worker.process.pid)
                continue
            if group is not None:
                tokens += sum(s.sequence.num_trained for s in group.samples)
            for _, name, value, _ in records:
                if name == "rollout/concurrency":
                    in_flight.append(value)
                elif name == "rollout/concurrency_cap":
                    caps.append(int(value))
                elif name == "rollout/vllm_retry_count":
                    retries += int(value)
        delay = _frac(delay0, run_queue_s(worker.process.pid), seconds)
        return Window(tokens / seconds, statistics.fmean(in_flight) if in_flight else float("nan"),
                      watch.mean_running(*window), delay, os.getloadavg()[0], caps, retries)
    finally:
        worker.stop()


def idle_fraction(server: VLLMServer, model_dir: Path, out: str, steps: int, max_staleness: int) -> tuple[float, float]:
    """(idle fraction, seconds per step) of a short training run."""
    config = AsyncGRPOConfig(
        output_dir=out, vllm_server_base_url=server.base_url, max_steps=steps, num_generations=8,
        max_completion_length=MAX_TOKENS, max_staleness=max_staleness, learning_rate=1e-5, use_cpu=True,
        gradient_checkpointing=False, save_strategy="no", report_to="none", disable_tqdm=True, token_budget=1024)
    trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=spread_reward, args=config, train_dataset=prompts())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "perf/step_s" in h][1:]  # the first step includes start-up
    wait = sum(h["perf/rollout_wait_s"] for h in logs)
    step = sum(h["perf/step_s"] for h in logs)
    return wait / step, step / len(logs)


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before each window (ramp-up)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per idle run; 0 skips that part")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from trainer.rollout.chat_template import render_prompt_ids

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024)) as server:
            prompt_ids = [render_prompt_ids(tokenizer, row["prompt"]) for row in prompts(9)]
            settings = RolloutSettings.from_server(server.base_url, str(model_dir), num_generations=8,
                                                   max_completion_length=MAX_TOKENS,
                                                   max_concurrent_rollouts=args.concurrency)
            raws, workers, fed = [], [], []
            with ServerWatch(server.base_url) as watch:
                for i in range(args.rounds):
                    raw_window = asyncio.run(raw_tokens_per_s(server.base_url, prompt_ids, args.concurrency,
                                                              args.warmup, args.seconds, watch))
                    worker_window = worker_tokens_per_s(settings, tokenizer, args.warmup, args.seconds, watch)
                    raws.append(raw_window.tokens_per_s)
                    workers.append(worker_window.tokens_per_s)
                    fed.append(worker_window.server_running / raw_window.server_running)
                    print(f"round {i + 1}: raw {raws[-1]:,.0f} tok/s ({raw_window.evidence()})\n"
                          f"         worker {workers[-1]:,.0f} tok/s ({worker_window.evidence()})", flush=True)
            raw, via_worker = statistics.median(raws), statistics.median(workers)
            if args.steps:
                idle4, step4 = idle_fraction(server, model_dir, str(Path(tmp) / "s4"), args.steps, 4)
                idle0, step0 = idle_fraction(server, model_dir, str(Path(tmp) / "s0"), args.steps, 0)
    print(f"generated tokens/s @ {args.concurrency} (median of {args.rounds}): raw {raw:,.0f}, through the rollout "
          f"worker {via_worker:,.0f} ({via_worker / raw:.2f}x); per round, worker / raw "
          f"{', '.join(f'{w / r:.2f}x' for r, w in zip(raws, workers, strict=True))} (median "
          f"{statistics.median(w / r for r, w in zip(raws, workers, strict=True)):.2f}x: each round's windows are "
          f"adjacent, so the paired ratio is the one the machine's drifting load disturbs least); server running "
          f"requests, worker / raw window (median): {statistics.median(fed):.2f}x")
    if not args.steps:
        return
    print(f"trainer idle fraction over {args.steps - 1} steps: max_staleness=4 {idle4:.1%} ({step4:.1f} s/step), "
          f"max_staleness=0 {idle0:.1%} ({step0:.1f} s/step)")


if __name__ == "__main__":
    main()
