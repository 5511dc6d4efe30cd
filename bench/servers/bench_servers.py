"""Rollout throughput over two vLLM servers against one, measured in the same run.

Command (repository root, after ``make setup``)::

    .venv/bin/python bench/servers/bench_servers.py \
        [--cores-each 1] [--concurrency 32] [--warmup 15] [--seconds 30] [--rounds 2]

Starts two vLLM CPU servers of the tiny model. With ``--cores-each N`` server A's engine is bound to
cores ``0..N-1`` and server B's to the next ``N`` (``VLLM_CPU_OMP_THREADS_BIND``), so that two servers
have twice the cores of one; ``--cores-each 0`` leaves vLLM's default (every server binds to every
core: on a small machine they then share them). Each round runs the real rollout worker
(``AsyncRolloutLoop`` in its spawned process: prompts rendered with the chat template, groups of 8,
scoring, the queue drained at once) against A alone, then against A and B (``vllm_server_base_url``
``"A,B"``: every rollout routed to the less loaded), with the same ceiling of rollouts in flight
(``--concurrency``), and counts the rollouts and generated tokens queued per second in a steady window
of ``--seconds`` after ``--warmup`` seconds. The two alternate for ``--rounds`` rounds, so a change in
the machine's load hits both; it prints every window, the median ratio (two servers / one) and the
cores each server had. The machine's load average is printed with each window: on a shared machine the
servers compete with other jobs for the same cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoTokenizer

from toolgym.kit.tiny_model import build_tiny_model
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.settings import RolloutSettings
from trainer.rollout.worker import RolloutWorker, WorkerChannels, spawn_context
from trainer.vllm.fleet import FleetState

MAX_TOKENS = 64


def spread_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Distinct rewards within a group, so every group is queued (none dropped)."""
    return [float(i) for i in range(len(completion_ids))]


def prompts(n: int = 512) -> Dataset:
    """Short counting prompts (single-turn rollouts)."""
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Increment the counter to {i % 9 + 1}."}]
                                         for i in range(n)]})


def cores(index: int, each: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for server ``index`` with ``each`` cores (``None``: vLLM's default)."""
    if each <= 0:
        return None
    first = index * each
    if first + each > (os.cpu_count() or 1):
        raise SystemExit(f"--cores-each {each}: two servers need {2 * each} cores, this machine has {os.cpu_count()}")
    return str(first) if each == 1 else f"{first}-{first + each - 1}"


def rollouts_per_s(urls: list[str], model_dir: Path, concurrency: int, warmup: float,
                   seconds: float) -> tuple[float, float]:
    """(rollouts/s, generated tokens/s) the worker queued in the window ``[warmup, warmup + seconds]``
    after its first group, sampling from ``urls``."""
    settings = RolloutSettings.from_server(",".join(urls), str(model_dir), max_completion_length=MAX_TOKENS,
                                           num_generations=8, max_concurrent_rollouts=concurrency, seed=0)
    ctx = spawn_context()
    channels = WorkerChannels.create(ctx, initial_allowance=10**12, initial_version=0,
                                     fleet=FleetState.create(ctx, len(urls), 0))
    kwargs = dict(processing_class=AutoTokenizer.from_pretrained(model_dir), dataset=prompts(),
                  reward_funcs=[spread_reward])
    worker = RolloutWorker(AsyncRolloutLoop, settings, kwargs, channels, timeout_s=120, ctx=ctx)
    worker.start()
    try:
        if worker.get(timeout_s=300) is None:
            raise SystemExit("the rollout worker queued nothing in 300 s")
        start = time.monotonic()
        window = (start + warmup, start + warmup + seconds)
        rollouts = tokens = 0
        while time.monotonic() < window[1]:
            group = worker.get(timeout_s=1.0)
            if group is None or time.monotonic() < window[0]:
                continue
            rollouts += len(group.samples)
            tokens += sum(sum(s.sequence.loss_mask) for s in group.samples)
        return rollouts / seconds, tokens / seconds
    finally:
        worker.stop()


def main() -> None:
    """Start the two servers, alternate one-server and two-server windows, print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the tiny model, built in a temporary folder)")
    parser.add_argument("--cores-each", type=int, default=1, help="cores bound to each server (0: vLLM's default)")
    parser.add_argument("--concurrency", type=int, default=32, help="ceiling of rollouts in flight, both setups")
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-servers-") as tmp:
        model_dir = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "model", seed=0)
        binds = [cores(i, args.cores_each) for i in range(2)]
        servers = [VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024,
                                               extra_env={"VLLM_CPU_OMP_THREADS_BIND": b} if b else {}))
                   for b in binds]
        try:
            for server in servers:
                server.start(wait=False)
            for server in servers:
                server.wait_ready()
            urls = [s.base_url for s in servers]
            print(f"server A: cores {binds[0] or 'all (vLLM default)'}; server B: cores {binds[1] or 'all'}; "
                  f"machine: {os.cpu_count()} cores")
            one: list[float] = []
            two: list[float] = []
            for r in range(args.rounds):
                for label, chosen, results in (("one server ", urls[:1], one), ("two servers", urls, two)):
                    per_s, tokens_per_s = rollouts_per_s(chosen, model_dir, args.concurrency, args.warmup,
                                                         args.seconds)
                    results.append(per_s)
                    print(f"round {r + 1} {label}: {per_s:6.2f} rollouts/s, {tokens_per_s:7.1f} generated tokens/s "
                          f"(load {os.getloadavg()[0]:.1f})", flush=True)
            ratio = statistics.median(two) / statistics.median(one)
            print(f"two servers / one: {ratio:.2f}x rollouts/s (medians of {args.rounds} rounds; "
                  f"{args.cores_each or 'all'} core(s) per server, concurrency {args.concurrency})")
        finally:
            for server in servers:
                server.stop()


if __name__ == "__main__":
    main()
