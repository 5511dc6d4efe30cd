"""Tree packing of a Gated DeltaNet hybrid (Qwen3.5-2B shape) against plain padding-free packing.

Command (on the GPU machine, from the repository root)::

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/packing/bench_hybrid.py

``--tiny`` runs every section on a tiny model (a CPU smoke test of the script; its timings mean nothing).
Carry ``fla-core`` (``.whl/``) for the ``auto`` and ``fla`` backends: ``auto`` trains with fla where
``trainer.training.delta_rule`` allows it (on Hopper with Triton < 3.7.1, after its on-device check
of fla's backward), else with the torch rule. The correctness reference is transformers' stock model
with its *torch* delta rule (transformers calls fla instead whenever fla is importable).
Sections (``--sections``, comma-separated):

* ``correctness``: a small float32 hybrid (Qwen3.5 layers, head dims 128), groups sharing prompts:
  log-probs and gradients of the tree-packed row (each delta-rule backend of ``--backends``)
  against each sample forwarded alone by the stock transformers model; and, where fla-core is
  installed, fla's forward on the same row.
* ``fla_check``: ``fla_backward_error`` (fla's guard-lifted backward against the torch rule) at the
  Qwen3.5 head dims in bf16, and whether training would use fla.
* ``throughput``: a Qwen3.5-2B-shaped random hybrid (24 layers, 18 Gated DeltaNet + 6 full attention,
  hidden 2048, vocabulary 248,320, tied embeddings) in bf16 with gradient checkpointing: trained
  tokens/s of the fused fwd+bwd step (``packed_grpo_loss``) on the rows ``RowPlanner`` makes with
  and without prefix sharing, for the two GRPO shapes of ``bench_packing.py``; then the same step
  on a full-attention Qwen3 of the same width, depth and vocabulary on the plain rows.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import traceback
from unittest import mock

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5

from bench.packing.bench_packing import Shape, grpo_samples, plan, rel_err, sync_time, train_step
from trainer.training.delta_rule import FLA_TOLERANCE, fla_backward_error, fla_usable, select_delta_rule
from trainer.training.logprobs import forward_packed
from trainer.training.packing import batch_metrics, build_row
from trainer.training.tree_attention import enable_tree_attention

ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}
QWEN3_5_2B = {  # the Qwen3.5-2B text model's shape, random weights
    "vocab_size": 248320, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": True, "max_position_embeddings": 32768, "rope_parameters": ROPE,
}
FULL_ATTENTION = {  # a Qwen3 of the same width, depth and vocabulary
    "vocab_size": 248320, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}
TINY_ROPE = {**ROPE, "mrope_section": [2, 1, 1]}
TINY = {**QWEN3_5_2B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "rope_parameters": TINY_ROPE}
TINY_FULL = {**FULL_ATTENTION, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def make(cls: type, config: object, dtype: torch.dtype, device: str, checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def correctness(backends: list[str], device: str) -> None:
    """Tree-packed hybrid vs each sample alone (stock model), float32, per delta-rule backend."""
    spec = {**TINY, "hidden_size": 256, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "head_dim": 128, "rope_parameters": {**ROPE, "mrope_section": [6, 5, 5]}}
    reference = make(Qwen3_5ForCausalLM, Qwen3_5TextConfig(**spec), torch.float32, device, checkpointing=False)
    shape = Shape("check", groups=3, prompt=200, completions=4, completion=90)
    samples = grpo_samples(shape, spec["vocab_size"])
    row = build_row(samples).to(device)
    ref_logp, ref_grads = [], None
    # The stock model calls fla whenever it is importable; the reference must be transformers' torch code.
    with mock.patch.object(modeling_qwen3_5, "torch_chunk_gated_delta_rule",
                           inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)):
        for s, sample in enumerate(samples):
            ids = torch.tensor(sample.sequence.input_ids, device=device)[None]
            logp = torch.log_softmax(reference(input_ids=ids).logits[0].float(), -1)
            positions = torch.tensor([i - 1 for i, m in enumerate(sample.sequence.loss_mask) if m], device=device)
            ref_logp.append(logp[positions].gather(1, row.target_ids[row.token_sample == s][:, None]).squeeze(1))
        ref = torch.cat(ref_logp)
        ref.sum().backward()
    ref_grads = [p.grad.clone() for p in reference.parameters()]
    print(f"correctness: {row.num_unique_tokens} of {row.num_unpacked_tokens} tokens forwarded", flush=True)
    for backend in backends:
        select_delta_rule(backend)
        model = enable_tree_attention(copy.deepcopy(reference))
        model.zero_grad(set_to_none=True)
        out = forward_packed(model, row, 1.0).logp
        out.sum().backward()
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        want = torch.cat([q.flatten() for q in ref_grads])
        # Per parameter, relative to the whole gradient's scale: some decay parameters get gradients
        # 1e-6 of the others', where float32 summation order alone gives large relative differences.
        worst = max((p.grad - q).norm().item() for p, q in zip(model.parameters(), ref_grads, strict=True))
        print(f"  {backend}: max |log-prob difference| {(out - ref).abs().max().item():.1e}, relative grad error "
              f"{rel_err(got, want):.1e} (all parameters), worst parameter {worst / want.norm().item():.1e} "
              "of the gradient's norm", flush=True)
    if device == "cuda":
        try:
            select_delta_rule("fla")
            model = enable_tree_attention(copy.deepcopy(reference))
            with torch.no_grad():
                out = forward_packed(model, row, 1.0).logp
            print(f"  fla forward: max |log-prob difference| {(out - ref).abs().max().item():.1e}", flush=True)
        except Exception as e:  # fla-core not carried, or it refuses
            print(f"  fla forward: {type(e).__name__}: {e}", flush=True)


def fla_check(device: str) -> None:
    """fla's lifted backward against the torch rule (``fla_backward_error``) per head dim and dtype."""
    dev = torch.device(device)
    # Qwen3.5 and Qwen3-Next have key and value head dims of 128. (Other head dims cost fla minutes of
    # autotuning each on the H200: K=256 had not finished in 4 minutes.)
    for dtype in (torch.bfloat16,):
        for key_dim in (128,):
            try:
                err = fla_backward_error(dev, 16, key_dim, 128, dtype)
                usable = fla_usable(dev, True, 16, key_dim, 128, dtype)
                print(f"  fla check {dtype} K={key_dim} V=128 H=16: worst relative error {err:.1e} "
                      f"(tolerance {FLA_TOLERANCE:g}): trains with fla: {usable}", flush=True)
            except Exception as e:  # noqa: BLE001  (fla missing, or a head dim its kernels refuse)
                print(f"  fla check {dtype} K={key_dim}: {type(e).__name__}: {e}", flush=True)


def table_line(model: torch.nn.Module, rows: dict[bool, list], label: str, shape: Shape, budget: int,
               device: str, repeats: int) -> str:
    """Warm up on every row length, time plain and tree rows (best of ``repeats``), one table line."""
    step = lambda r: train_step(model, r)  # noqa: E731
    for r in {r.num_unique_tokens: r for share in rows for r in rows[share]}.values():
        print(f"  warm-up {label} {r.num_unique_tokens} tokens: {sync_time(lambda r=r: step(r), device):.1f}s",
              flush=True)
    best = {}
    for share in (False, True):
        times = [sum(sync_time(lambda r=r: step(r), device) for r in rows[share]) for _ in range(repeats)]
        best[share] = sum(r.num_trained for r in rows[share]) / min(times)
        print(f"  {shape.name} {label} share={share}: {len(rows[share])} rows, {[round(t, 2) for t in times]} s",
              flush=True)
    ratio = batch_metrics(rows[True], budget)["batch/packing_ratio"]
    line = (f"| {shape.name} | {label} | {ratio:.2f} | {best[False]:,.0f} | {best[True]:,.0f} | "
            f"{best[True] / best[False]:.2f}x | {best[True] / best[False] / ratio:.2f} |")
    print(line, flush=True)
    return line


def throughput(hybrid_spec: dict, full_spec: dict, shapes: list[Shape], budget: int, backends: list[str],
               device: str, repeats: int) -> list[str]:
    """Fused fwd+bwd trained tokens/s: hybrid plain vs tree (per backend), then the full-attention Qwen3."""
    rows = {}
    for shape in shapes:
        samples = grpo_samples(shape, hybrid_spec["vocab_size"])
        rows[shape.name] = {share: [r.to(device) for r in plan(samples, budget, share)] for share in (False, True)}
    lines = []
    hybrid = enable_tree_attention(make(Qwen3_5ForCausalLM, Qwen3_5TextConfig(**hybrid_spec), torch.bfloat16,
                                        device, checkpointing=True))
    for shape in shapes:
        for backend in backends:
            select_delta_rule(backend)
            lines.append(table_line(hybrid, rows[shape.name], f"Qwen3.5-2B hybrid, {backend}", shape, budget,
                                    device, repeats))
    hybrid = None  # free its memory before the next model
    if device == "cuda":
        torch.cuda.empty_cache()
    full = enable_tree_attention(make(Qwen3ForCausalLM, Qwen3Config(**full_spec), torch.bfloat16, device,
                                      checkpointing=True))
    lines += [table_line(full, rows[shape.name], "full-attention Qwen3, same width", shape, budget, device, repeats)
              for shape in shapes]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and samples (CPU smoke test)")
    parser.add_argument("--sections", default="correctness,throughput")
    parser.add_argument("--backends", default="torch", help="delta-rule backends (select_delta_rule)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--groups", default="4,3", help="groups of the two shapes")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = args.backends.split(",")
    hybrid_spec, full_spec = (TINY, TINY_FULL) if args.tiny else (QWEN3_5_2B, FULL_ATTENTION)
    budget, scale = (512, 10) if args.tiny else (16384, 1)
    g1, g2 = (int(g) for g in args.groups.split(","))
    shapes = [
        Shape("prompt 1000 + 8 x 300", groups=g1, prompt=1000 // scale, completions=8, completion=300 // scale),
        Shape("prompt 3000 + 8 x 150", groups=g2, prompt=3000 // scale, completions=8, completion=150 // scale),
    ]
    print(f"device {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), torch {torch.__version__}")
    tables = []
    for name in args.sections.split(","):
        try:
            if name == "fla_check":
                fla_check(device)
            elif name == "correctness":
                correctness(backends, device)
            elif name == "throughput":
                rows = throughput(hybrid_spec, full_spec, shapes, budget, backends, device, args.repeats)
                tables.append("| shape | model, delta rule | packing ratio | plain trained tok/s | tree trained tok/s "
                              "| speedup | speedup / ratio |\n" + "|---" * 7 + "|\n" + "\n".join(rows))
        except Exception:  # keep the other sections' figures: a device call is expensive
            traceback.print_exc()
    print("\n" + "\n\n".join(tables))


if __name__ == "__main__":
    main()
