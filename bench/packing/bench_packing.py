"""Tree packing against plain padding-free packing, and the memory of chunked log-probs.

Command (on the GPU machine, from the repository root)::

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/packing/bench_packing.py

``--tiny`` runs every section on a tiny model and short samples (a CPU smoke test of the script).
Sections (``--sections``, comma-separated):

* ``correctness``: on CUDA, a small float32 model: log-probs and gradients of a tree-packed row
  (compiled FlexAttention, BlockMask from DFS intervals) against each sample forwarded alone with
  stock SDPA.
* ``throughput``: a Qwen3-0.6B-shaped random model in bf16 with gradient checkpointing; the same
  samples packed by ``RowPlanner`` with and without prefix sharing (both run on the tree-attention
  backend: plain packing is its block-diagonal special case); trained tokens per second of the
  fwd+bwd step (``forward_packed`` + ``grpo_loss`` + backward), for two GRPO shapes.
* ``memory``: peak memory of fwd+bwd on one 16,384-token row (every token but the first trained,
  vocabulary 151,936): the model without logits, the chunked log-probs + loss, and a plain
  full-logits loss; with and without gradient checkpointing.
"""

from __future__ import annotations

import argparse
import copy
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.logprobs import forward_packed
from trainer.loss import LossConfig, grpo_loss
from trainer.packing import PackedRow, RowPlanner, batch_metrics, build_row
from trainer.rollout_types import TrainingSample, TrainingSequence
from trainer.tree_attention import enable_tree_attention, packed_hidden_states

QWEN3_06B = {
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}
TINY = {**QWEN3_06B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


@dataclass
class Shape:
    """A GRPO workload: groups of ``completions`` samples sharing a ``prompt``-token prompt."""

    name: str
    groups: int
    prompt: int
    completions: int
    completion: int


def make_model(spec: dict, dtype: torch.dtype, device: str, checkpointing: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(Qwen3Config(**spec), dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def grpo_samples(shape: Shape, vocab: int, seed: int = 0) -> list[TrainingSample]:
    """Random token ids; sampler log-probs near the truth does not matter for timing."""
    rng = random.Random(seed)
    out = []
    for g in range(shape.groups):
        prompt = [rng.randrange(vocab) for _ in range(shape.prompt)]
        for _ in range(shape.completions):
            ids = prompt + [rng.randrange(vocab) for _ in range(shape.completion)]
            mask = [0] * shape.prompt + [1] * shape.completion
            seq = TrainingSequence(ids, mask, [-2.0 * m for m in mask])
            out.append(TrainingSample(seq, advantage=rng.uniform(-1, 1), group_id=g, policy_version=0))
    return out


def plan(samples: list[TrainingSample], budget: int, share: bool) -> list[PackedRow]:
    """Every micro-batch (one row each: one process) that the planner makes of ``samples``."""
    planner, rows, pending = RowPlanner(1, budget, share_prefixes=share), [], list(samples)
    while pending:
        while pending and planner.add(pending[0]):
            pending.pop(0)
        rows.extend(planner.rows())
    return rows


def sync_time(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def train_step(model: Qwen3ForCausalLM, row: PackedRow, chunk_size: int = 512) -> None:
    logps = forward_packed(model, row, temperature=1.0, chunk_size=chunk_size)
    loss, _ = grpo_loss(logps, row, LossConfig(), num_trained_global=row.num_trained)
    loss.backward()
    model.zero_grad(set_to_none=True)


def correctness(device: str) -> None:
    """Tree-packed (compiled flex on CUDA) vs alone (stock SDPA), float32, values and gradients."""
    spec = {**TINY, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}
    reference = make_model(spec, torch.float32, device, checkpointing=False)
    model = enable_tree_attention(copy.deepcopy(reference))
    samples = grpo_samples(Shape("check", groups=3, prompt=200, completions=4, completion=90), spec["vocab_size"])
    row = build_row(samples).to(device)
    out = forward_packed(model, row, temperature=0.9, chunk_size=128)
    out.logp.sum().backward()
    ref = []
    for s, smp in enumerate(samples):
        logits = reference(input_ids=torch.tensor(smp.sequence.input_ids, device=device)[None]).logits[0] / 0.9
        pos = torch.tensor([i - 1 for i, m in enumerate(smp.sequence.loss_mask) if m], device=device)
        ref.append(torch.log_softmax(logits.float()[pos], -1).gather(1, row.target_ids[row.token_sample == s, None]))
    ref_logp = torch.cat(ref).squeeze(1)
    ref_logp.sum().backward()
    err = (out.logp - ref_logp).abs().max().item()
    grad_err = max(
        ((p.grad - q.grad).norm() / q.grad.norm()).item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    print(f"correctness: {row.num_trained} tokens, {row.num_unique_tokens}/{row.num_unpacked_tokens} forwarded; "
          f"max |logp - alone| = {err:.2e}, max relative grad error = {grad_err:.2e}", flush=True)


def step_flops(rows: list[PackedRow], spec: dict) -> float:
    """FLOPs of the fwd+bwd step by a simple model: every matmul once forward, once recomputed
    (checkpointing) and twice backward; attention per allowed query-key pair; LM head per trained token."""
    d, head_dim = spec["hidden_size"], spec["head_dim"]
    q_dim, kv_dim = spec["num_attention_heads"] * head_dim, spec["num_key_value_heads"] * head_dim
    layer_params = 2 * d * q_dim + 2 * d * kv_dim + 3 * d * spec["intermediate_size"]
    per_token = 2 * spec["num_hidden_layers"] * layer_params * 4
    per_pair = spec["num_hidden_layers"] * 2 * (2 * q_dim) * 4  # q.k and p.v
    per_trained = 2 * d * spec["vocab_size"] * 4
    return sum(
        r.num_unique_tokens * per_token + r.attention_cost * per_pair + r.num_trained * per_trained for r in rows
    )


def throughput(spec: dict, shapes: list[Shape], budget: int, device: str, repeats: int) -> list[str]:
    model = enable_tree_attention(make_model(spec, torch.bfloat16, device, checkpointing=True))
    lines = []
    for shape in shapes:
        samples = grpo_samples(shape, spec["vocab_size"])
        result = {}
        for share in (False, True):
            rows = [r.to(device) for r in plan(samples, budget, share)]
            for r in {r.num_unique_tokens: r for r in rows}.values():  # compile each row length
                seconds = sync_time(lambda r=r: train_step(model, r), device)
                print(f"  warm-up {r.num_unique_tokens} tokens: {seconds:.1f}s")
            times = [sum(sync_time(lambda r=r: train_step(model, r), device) for r in rows) for _ in range(repeats)]
            trained = sum(r.num_trained for r in rows)
            forwarded = sum(r.num_unique_tokens for r in rows)
            m = batch_metrics(rows, budget)
            result[share] = (trained / min(times), forwarded / min(times), len(rows), m, step_flops(rows, spec))
            print(f"  {shape.name} share={share}: {len(rows)} rows, {trained} trained, {forwarded} forwarded, "
                  f"best {min(times):.3f}s of {[round(t, 3) for t in times]}", flush=True)
        (plain_tps, plain_fps, plain_rows, _, plain_flops), (tree_tps, tree_fps, tree_rows, m, tree_flops) = (
            result[False], result[True]
        )
        ratio = m["batch/packing_ratio"]
        lines.append(
            f"| {shape.name} | {ratio:.2f} | {m['batch/samples_per_row']:.1f} | {plain_rows} / {tree_rows} | "
            f"{plain_tps:,.0f} | {tree_tps:,.0f} | {tree_tps / plain_tps:.2f}x | {tree_tps / plain_tps / ratio:.2f} | "
            f"{plain_flops / tree_flops:.2f}x | {plain_fps:,.0f} / {tree_fps:,.0f} |"
        )
    return lines


def peak_memory(step: Callable[[], None], device: str) -> tuple[float, float]:
    """(peak GiB during ``step``, seconds)."""
    if device != "cuda":
        return float("nan"), sync_time(step, device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    seconds = sync_time(step, device)
    return torch.cuda.max_memory_allocated() / 2**30, seconds


def memory(spec: dict, tokens: int, device: str) -> list[str]:
    vocab = spec["vocab_size"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=g).tolist()
    seq = TrainingSequence(ids, [0] + [1] * (tokens - 1), [0.0] + [-2.0] * (tokens - 1))
    row = build_row([TrainingSample(seq, advantage=1.0, group_id=0, policy_version=0)]).to(device)
    lines = []
    for checkpointing in (True, False):
        model = enable_tree_attention(make_model(spec, torch.bfloat16, device, checkpointing))

        def no_logits() -> None:
            packed_hidden_states(model, row).float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        def full_logits() -> None:
            logits = model.get_output_embeddings()(packed_hidden_states(model, row)).float()  # (N, V)
            logp = torch.log_softmax(logits, -1)[row.pred_index].gather(1, row.target_ids[:, None]).squeeze(1)
            (-(row.advantages * logp).sum() / row.num_trained).backward()
            model.zero_grad(set_to_none=True)

        variants = [("model, no logits", no_logits), ("full logits", full_logits)]
        chunks = (256, 512, 1024) if checkpointing else (512,)
        variants += [(f"chunked ({c})", lambda c=c: train_step(model, row, c)) for c in chunks]
        no_logits()  # compile for this row length
        base = None
        for name, fn in variants:
            try:
                gib, seconds = peak_memory(fn, device)
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                lines.append(f"| {checkpointing} | {name} | OOM | | |")
                continue
            base = base or gib
            lines.append(f"| {checkpointing} | {name} | {gib:.2f} | {gib / base:.2f}x | {seconds:.3f} |")
            print(lines[-1], flush=True)
        del model
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and samples (CPU smoke test)")
    parser.add_argument("--sections", default="correctness,throughput,memory")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sections = args.sections.split(",")
    spec = TINY if args.tiny else QWEN3_06B
    budget, mem_tokens = (512, 256) if args.tiny else (16384, 16384)
    scale = 10 if args.tiny else 1
    shapes = [
        Shape("prompt 1000 + 8 x 300", groups=8, prompt=1000 // scale, completions=8, completion=300 // scale),
        Shape("prompt 3000 + 8 x 150", groups=6, prompt=3000 // scale, completions=8, completion=150 // scale),
    ]
    print(f"device {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), torch {torch.__version__}")
    tables = []
    for name in sections:
        try:
            if name == "correctness":
                correctness(device)
            elif name == "throughput":
                rows = throughput(spec, shapes, budget, device, args.repeats)
                tables.append(
                    "| shape | packing ratio | samples/row | rows plain / tree | plain trained tok/s "
                    "| tree trained tok/s | speedup | speedup / ratio | FLOP-model speedup "
                    "| forwarded tok/s plain / tree |\n|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
                )
            elif name == "memory":
                rows = memory(spec, mem_tokens, device)
                tables.append(
                    f"| checkpointing | {mem_tokens}-token row | peak GiB | vs no logits | step s |\n"
                    "|---|---|---|---|---|\n" + "\n".join(rows)
                )
        except Exception:  # keep the other sections' figures: a device call is expensive
            traceback.print_exc()
    print("\n" + "\n\n".join(tables))


if __name__ == "__main__":
    main()
