"""Where the compiled step leaves the GPU idle: the gaps between kernels of one tree-packed step.

Command (on the GPU machine, from the repository root)::

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/packing/bench_gaps.py

One Qwen3-0.6B-shaped step (bf16, gradient checkpointing, decoder layers compiled for static shapes,
the row padded to a multiple of 1,024 tokens as the trainer does) on the first row of
``bench_packing.varying_rows``, for each LM-head chunk size (``--chunks``; the trainer's is
``FUSED_CHUNK_SIZE``): the step's wall time and hardware FLOP utilisation (HFU, FLOPs as
``bench_packing.step_flops`` counts them over the bf16 matmul peak measured in the same run). For
512 and the trainer's chunk, one step profiled with CPU and CUDA activities: wall time, kernel time,
the time no kernel runs, and the largest sources of that idle time by the code that launched the
kernel after each gap (innermost frame in ``trainer/``). The profiler slows the CPU side, so its
gaps are longer than the unprofiled step's; compare them with each other.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import tempfile
from collections.abc import Callable

import torch

from bench.packing.bench_packing import (
    QWEN3,
    make_model,
    measured_peak,
    step_flops,
    sync_time,
    train_step,
    varying_rows,
)
from trainer.training.compile import compile_decoder_layers
from trainer.training.logprobs import FUSED_CHUNK_SIZE
from trainer.training.packing import PackedRow
from trainer.training.tree_attention import enable_tree_attention


def trace_gaps(step: Callable[[], None], min_gap_us: float = 10.0, top: int = 15) -> list[str]:
    """Profile one call of ``step``: kernel time, idle time, and idle time by launching frame."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA], with_stack=True
    ) as prof:
        wall = sync_time(step, "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    runtime = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    frames = sorted((e for e in events if e.get("cat") == "python_function"), key=lambda e: e["ts"])
    ours = [f for f in frames if "trainer/" in f["name"] or "bench/" in f["name"]]
    starts = [f["ts"] for f in ours]
    syncs = [e for e in events if e.get("cat") == "cuda_runtime"
             and any(s in e["name"] for s in ("Synchronize", "cudaMemcpy", "EventSynchronize"))]

    def frame_at(ts: float) -> str:
        """The innermost trainer/ or bench/ frame running at CPU time ``ts``."""
        for i in range(bisect.bisect_right(starts, ts) - 1, -1, -1):  # the latest-starting frame holding ts
            if ours[i]["ts"] + ours[i]["dur"] >= ts:
                return str(ours[i]["name"])
        return "(no trainer/ frame: the backward's thread)"

    busy, idle, end = 0.0, 0.0, None
    by_frame: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for k in kernels:
        start, stop = k["ts"], k["ts"] + k["dur"]
        if end is not None and start - end > min_gap_us:
            launch = runtime.get(k["args"].get("correlation"))
            where = frame_at(launch["ts"]) if launch else "?"
            synced = any(end - 1 <= s["ts"] + s["dur"] and s["ts"] <= start for s in syncs)
            key = f"{where}{' [after a sync]' if synced else ''} -> {k['name'][:40]}"
            by_frame[key] += start - end
            count[key] += 1
            idle += start - end
        busy += k["dur"] if end is None or start >= end else max(0.0, stop - end)
        end = stop if end is None else max(end, stop)
    first = kernels[0]["ts"] if kernels else 0.0
    lines = [f"wall {wall * 1e3:.1f} ms, kernels busy {busy / 1e3:.1f} ms, gaps > {min_gap_us:.0f} us: "
             f"{idle / 1e3:.1f} ms; first kernel after {(first - min(e['ts'] for e in frames)) / 1e3:.1f} ms "
             f"of CPU; {len(syncs)} sync calls"]
    lines += [f"  {us / 1e3:7.2f} ms in {count[key]:4d} gaps: {key}" for key, us in by_frame.most_common(top)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="0.6B")
    parser.add_argument("--bucket", type=int, default=1024)
    parser.add_argument("--chunks", default="512,1024,1536,2048,4096", help="LM-head chunk sizes to time")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    spec = QWEN3[args.model]
    peak = measured_peak("cuda")
    row: PackedRow = varying_rows(spec["vocab_size"], 1, 16384)[0].to("cuda")
    padded = row.padded_to_multiple(args.bucket)
    flops = step_flops([row], spec, 3)
    print(f"peak {peak / 1e12:.0f} TFLOP/s; row {row.num_unique_tokens} tokens (padded {padded.input_ids.numel()}), "
          f"{row.num_trained} trained", flush=True)
    torch._dynamo.reset()
    model = enable_tree_attention(make_model(spec, torch.bfloat16, "cuda", checkpointing=True))
    compile_decoder_layers(model, dynamic=False)
    for chunk in (int(c) for c in args.chunks.split(",")):
        for _ in range(2):  # compiles (the layers once, the head's two kernels per chunk shape)
            train_step(model, padded, chunk_size=chunk)
        times = sorted(sync_time(lambda: train_step(model, padded, chunk_size=chunk), "cuda")
                       for _ in range(args.repeats))
        print(f"LM-head chunk {chunk}: best {times[0] * 1e3:.1f} ms, median {times[len(times) // 2] * 1e3:.1f} ms, "
              f"HFU {flops / times[0] / peak:.1%}", flush=True)
        if chunk in (512, FUSED_CHUNK_SIZE):
            for line in trace_gaps(lambda: train_step(model, padded, chunk_size=chunk)):
                print(line, flush=True)


if __name__ == "__main__":
    main()
