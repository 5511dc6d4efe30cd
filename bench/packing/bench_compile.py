"""What compiling costs a run's first steps, from a cold and from a warm compile cache (issue 38).

Command (on the GPU machine, from the repository root)::

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/packing/bench_compile.py --models 0.6B,1.7B,4B --steps 10

``--tiny`` runs on a tiny model (a CPU smoke test of the script: eager only, its timings mean nothing).
Every run is a fresh process (this script with ``--child``) whose compile cache
(``trainer/training/compile_cache.py``) is a folder of this script's ``--cache-root``, so "cold" is an
empty folder and "warm" a second process on the folder a cold run filled: what a second run of the
same shapes on the same machine finds. For each Qwen3 shape (``bench_packing.QWEN3``, random weights,
bf16, gradient checkpointing, the fused loss), the ``--steps`` rows of ``bench_packing.varying_rows``
(length changing every step, 12.8k-16.1k tokens at the budget of 16,384), in the order of ``--runs``:

* ``eager-cold``, ``eager-warm``: the eager step (FlexAttention and the head loss still compile);
* ``compiled-cold``, ``compiled-warm``: the trainer's compiled step (layers compiled for static
  shapes, rows padded to buckets of ``--bucket``), after the trainer's warm-up
  (``trainer/training/compile_warmup.py``) of the ``--warm-buckets`` largest buckets: in a run it
  compiles while the first rollouts are generated, so it is timed apart ("warm-up s"), and "steps s"
  is what the trainer then spends on the steps. After the sequence, the first row again
  (``--fixed-repeats`` times): the fixed-row tokens/s that the varying rows' steady state is held to.

``--dynamic`` compiles the layers with dynamic shapes instead (``compile_row_bucket=None``: rows not
padded, the warm-up compiles one row of the budget's length); ``--bucket 16384 --warm-buckets 1``
pads every row to the budget (one static graph). ``--inductor`` sets inductor options of the runs
(JSON), to measure compile-time trades. Each result (the JSON after its table line) has
``phases_s``: the seconds of each of dynamo's timed compile phases in the process (nested, so they
overlap: ``bytecode_tracing`` is dynamo's tracing, ``create_aot_dispatcher_function`` AOT autograd
with inductor inside it, ``fw_compiler_base`` / ``bw_compiler`` inductor's forward and backward,
``async_compile.wait`` the wait for Triton's compile workers, ``AOTAutogradCache.inductor_load`` a
warm cache's load); and ``tuned_kernels``, the Triton kernels autotuned (fla's; their seconds are in
the compile seconds, ``CompileTracker``).

``--hybrid`` adds the Qwen3.5-2B-shaped Gated DeltaNet hybrid (``bench_hybrid.QWEN3_5_2B``, the
``auto`` delta rule: fla where installed and checked) with the compiled step and no warm-up: its
first and second step, cold then warm (``--hybrid-timeout`` seconds per process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.packing.bench_packing import QWEN3, TINY, make_model, sync_time, train_step, varying_rows
from trainer.training.compile import CompileTracker, RowBuckets, compile_decoder_layers
from trainer.training.compile_cache import CACHE_ENV, cache_versions, use_compile_cache
from trainer.training.compile_warmup import CompileWarmUp, expected_lengths, grpo_step
from trainer.training.packing import PackedRow
from trainer.training.tree_attention import enable_tree_attention

BUDGET = 16384
RUNS = ("eager-cold", "compiled-cold", "eager-warm", "compiled-warm")


def _cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k: int(v) for k, v in counters["inductor"].items() if "cache" in k}


def _phases() -> dict[str, float]:
    """Seconds of each of dynamo's timed compile phases in this process (tracing, AOT autograd,
    inductor's lowering and code generation, waiting for Triton's compile workers, cache loads)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {k: round(sum(v), 2) for k, v in sorted(compilation_time_metrics.items(), key=lambda kv: -sum(kv[1]))
            if sum(v) >= 0.05}


def _hybrid_model(device: str) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from bench.packing.bench_hybrid import QWEN3_5_2B, make

    return make(Qwen3_5ForCausalLM, Qwen3_5TextConfig(**QWEN3_5_2B), torch.bfloat16, device, checkpointing=True)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process: the figures of one table line."""
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = use_compile_cache(None)  # the parent set TOOLGYM_COMPILE_CACHE
    compiled = args.run.startswith("compiled") or args.model == "hybrid"
    if args.model == "hybrid":
        model = enable_tree_attention(_hybrid_model(device))
        vocab = int(model.config.vocab_size)
    else:
        spec = QWEN3.get(args.model, TINY)
        model = enable_tree_attention(make_model(spec, torch.bfloat16, device, checkpointing=True))
        vocab = spec["vocab_size"]
    budget = BUDGET if args.model != "tiny" else 512
    rows = [r.to(device) for r in varying_rows(vocab, args.steps, budget, scale=1 if args.model != "tiny" else 10)]
    if args.inductor:  # inductor options of this run (compile-time trades), e.g. '{"triton.autotune_pointwise": false}'
        import torch._inductor.config as inductor_config

        inductor_config.patch(json.loads(args.inductor)).__enter__()
    tracker = CompileTracker(announce=False)
    buckets = RowBuckets(args.bucket) if compiled and not args.dynamic else None
    if compiled and device == "cuda":
        compile_decoder_layers(model, dynamic=args.dynamic)
    setup_s = time.perf_counter() - started
    warm_s, warm_compiles = 0.0, (0.0, 0)
    if compiled and args.warm_buckets and args.model != "hybrid":
        lengths = expected_lengths(budget, None if args.dynamic else args.bucket)[:args.warm_buckets]
        warm = CompileWarmUp(model, grpo_step(model, 1.0), lambda: lengths, pad=buckets, device=device)
        warm.start()
        warm.wait()
        warm_s, warm_compiles = warm.seconds, tracker.take()

    def prepared(row: PackedRow) -> PackedRow:
        return buckets(row) if buckets is not None else row

    times, compiles = [], []
    for row in rows:
        times.append(sync_time(lambda row=row: train_step(model, prepared(row)), device))
        compiles.append(tracker.take())
    steady = [i for i, (_, n) in enumerate(compiles) if n == 0]
    steady_tps = (sum(rows[i].num_unique_tokens for i in steady) / sum(times[i] for i in steady)) if steady else 0.0
    fixed = [sync_time(lambda: train_step(model, prepared(rows[0])), device) for _ in range(args.fixed_repeats)]
    fixed_tps = rows[0].num_unique_tokens / min(fixed) if fixed else 0.0
    result: dict[str, Any] = {
        "model": args.model, "run": args.run, "cache": str(cache), "setup_s": setup_s, "warm_up_s": warm_s,
        "warm_up_compilations": warm_compiles[1], "warm_up_compile_s": warm_compiles[0], "step_s": times,
        "steps_s": sum(times), "compilations": sum(n for _, n in compiles),
        "compile_s": sum(s for s, _ in compiles),
        "stalls": [round(t, 1) for t, (_, n) in zip(times, compiles, strict=True) if n],
        "steady_tok_s": steady_tps, "fixed_tok_s": fixed_tps, "tokens": [r.num_unique_tokens for r in rows],
        "cache_counters": _cache_counters(), "process_s": time.perf_counter() - started,
        "phases_s": _phases(), "tuned_kernels": tracker.tuned,
    }
    if args.model == "hybrid":
        from trainer.training.delta_rule import _fla_installed, fla_usable

        result["fla"] = bool(_fla_installed()) and fla_usable(torch.device(device), True, 16, 128, 128, torch.bfloat16)
    return result


def run_child(model: str, run: str, folder: Path, args: argparse.Namespace, timeout: float,
              steps: int) -> dict[str, Any]:
    """``run`` of ``model`` (``steps`` rows) in a fresh process whose compile cache is ``folder``."""
    command = [sys.executable, __file__, "--child", "--model", model, "--run", run, "--steps", str(steps),
               "--bucket", str(args.bucket), "--warm-buckets", str(args.warm_buckets),
               "--fixed-repeats", str(args.fixed_repeats), "--inductor", args.inductor]
    command += ["--dynamic"] if args.dynamic else []
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, CACHE_ENV: str(folder), "PYTHONPATH": path}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "run": run, "timeout": timeout}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        print(done.stdout[-3000:], done.stderr[-3000:], flush=True)
        return {"model": model, "run": run, "error": done.returncode}
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    result["wall_s"] = time.perf_counter() - start
    return result


def table_line(r: dict[str, Any], eager: dict[str, Any] | None) -> str:
    """A markdown line of the results of one run; "vs eager" divides its warm-up + steps by eager's steps."""
    if "timeout" in r or "error" in r:
        why = f"did not finish in {r['timeout']:.0f} s" if "timeout" in r else f"failed ({r['error']})"
        return f"| {r['model']} | {r['run']} | {why} | | | | | | | | |"
    total = r["warm_up_s"] + r["steps_s"]
    ratio = f"{total / eager['steps_s']:.2f}x" if eager and "steps_s" in eager else ""
    steady, fixed = r["steady_tok_s"], r["fixed_tok_s"]
    counters = r["cache_counters"]
    hits = f"{counters.get('fxgraph_cache_hit', 0)} / {counters.get('fxgraph_cache_miss', 0)}"
    return (f"| {r['model']} | {r['run']} | {r['warm_up_s']:.1f} ({r['warm_up_compilations']}) | "
            f"{r['step_s'][0]:.1f} | {r['steps_s']:.1f} | {total:.1f} | {ratio} | "
            f"{r['compilations']} {r['stalls']} | {steady:,.0f} | {steady / fixed if fixed else 0:.2f} | {hits} |")


HEADER = ("| model | run | warm-up s (compilations) | first step s | steps s | warm-up + steps s | vs eager's steps "
          "| step compilations [stalls s] | steady forwarded tok/s | steady / fixed row | FX cache hits / misses |\n"
          + "|---" * 11 + "|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="0.6B,1.7B,4B")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"in order, from {RUNS}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bucket", type=int, default=1024, help="compile_row_bucket")
    parser.add_argument("--warm-buckets", type=int, default=4, help="largest buckets the warm-up compiles")
    parser.add_argument("--fixed-repeats", type=int, default=3)
    parser.add_argument("--dynamic", action="store_true",
                        help="compiled runs: dynamic-shape layers, rows not padded (compile_row_bucket=None)")
    parser.add_argument("--inductor", default="", help="inductor options of the compiled runs, as JSON")
    parser.add_argument("--hybrid", action="store_true", help="the Qwen3.5-2B hybrid's first steps, cold and warm")
    parser.add_argument("--hybrid-timeout", type=float, default=300.0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    parser.add_argument("--cache-root", default=None, help="folder of the runs' caches (default: a temporary one)")
    parser.add_argument("--tiny", action="store_true", help="tiny model, eager runs (CPU smoke test)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    if args.tiny:
        args.models, args.runs = "tiny", "eager-cold,eager-warm"
    root = Path(args.cache_root or tempfile.mkdtemp(prefix="bench-compile-"))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}; "
          f"caches under {root}; cache key {cache_versions()}", flush=True)
    lines = []
    for model in filter(None, args.models.split(",")):  # --models "" --hybrid: the hybrid alone
        results: dict[str, dict[str, Any]] = {}
        for run in filter(None, args.runs.split(",")):
            folder = root / model / run.split("-")[0]  # a cold run's folder is the warm run's
            results[run] = run_child(model, run, folder, args, args.timeout, args.steps)
            eager = results.get(f"eager-{run.split('-')[1]}")
            lines.append(table_line(results[run], eager))
            print(lines[-1], json.dumps(results[run]), flush=True)
    if args.hybrid:
        for run in ("hybrid-cold", "hybrid-warm"):
            result = run_child("hybrid", run, root / "hybrid", args, args.hybrid_timeout, 2)
            lines.append(table_line(result, None) + (f" fla: {result.get('fla')}" if "fla" in result else ""))
            print(lines[-1], json.dumps(result), flush=True)
    print("\n" + HEADER + "\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
