"""Tree packing against plain padding-free packing, and the memory of chunked log-probs.

Command (on the GPU machine, from the repository root)::

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/packing/bench_packing.py

``--tiny`` runs every section on a tiny model and short samples (a CPU smoke test of the script).
Sections (``--sections``, comma-separated):

* ``correctness``: on CUDA, a small float32 model: log-probs and gradients of a tree-packed row
  (compiled FlexAttention, BlockMask from DFS intervals) against each sample forwarded alone with
  stock SDPA.
  Then, on CUDA, the fused head loss (``packed_grpo_loss``, compiled softmax passes) against
  ``forward_packed`` + ``grpo_loss``: loss, statistics and gradients, float32, both loss modes;
  and the LM head alone in bf16 at the Qwen3 vocabulary (gradient relative errors).
* ``throughput``: a Qwen3-0.6B-shaped random model in bf16 with gradient checkpointing; the same
  samples packed by ``RowPlanner`` with and without prefix sharing (both run on the tree-attention
  backend: plain packing is its block-diagonal special case); trained tokens per second of the
  fwd+bwd step for two GRPO shapes, with the fused loss (``packed_grpo_loss`` + backward, what
  ``training_step`` runs) and the unfused one (``forward_packed`` + ``grpo_loss`` + backward).
* ``head``: the LM head + loss alone (from bf16 hidden states of 9,600 trained tokens), fused and
  unfused, against the time of its matmuls alone.
* ``memory``: peak memory of fwd+bwd on one 16,384-token row (every token but the first trained,
  vocabulary 151,936): the model without logits, the chunked log-probs + loss (fused and not),
  and a plain full-logits loss; with and without gradient checkpointing.
* ``profile``: the CUDA kernels of one tree-packed fused step of the first shape, by total time
  (``--profile-compiled``: of the compiled step).
* ``compiled``: Qwen3 0.6B, 1.7B and 4B shapes (``--models``): the same ``--steps`` rows, whose
  length changes at every step (GRPO groups of random prompt and completion lengths, no warm-up per
  length), trained eager and then with the decoder layers compiled (``compile_training_step``):
  hardware FLOP utilisation (recomputation included) and MFU (``trainer.training.flops``) of the
  steps without a compilation, against the bf16 matmul peak measured in the same run; the
  compilations and the steps they stalled.
* ``largest``: one full-parameter AdamW step on a 16,384-token row for Qwen3 8B and 14B shapes
  (``--largest``), bf16 weights and optimizer state, and float32 master weights with bf16
  autocast: peak memory, or OOM.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.records import TrainingSample, TrainingSequence
from trainer.training.logprobs import (
    DEFAULT_CHUNK_SIZE,
    FUSED_CHUNK_SIZE,
    forward_packed,
    head_loss_from_hidden,
    logprobs_from_hidden,
)
from trainer.training.loss import LossConfig, _token_losses, grpo_loss, packed_grpo_loss
from trainer.training.packing import PackedRow, RowPlanner, batch_metrics, build_row
from trainer.training.tree_attention import enable_tree_attention, packed_hidden_states

QWEN3_06B = {
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}
QWEN3 = {  # the released Qwen3 dense shapes (config.json of each), random weights
    "0.6B": QWEN3_06B,
    "1.7B": {**QWEN3_06B, "hidden_size": 2048, "intermediate_size": 6144},
    "4B": {**QWEN3_06B, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
           "num_attention_heads": 32},
    "8B": {**QWEN3_06B, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32, "tie_word_embeddings": False},
    "14B": {**QWEN3_06B, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
            "num_attention_heads": 40, "tie_word_embeddings": False},
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


def train_step(model: Qwen3ForCausalLM, row: PackedRow, chunk_size: int | None = None, fused: bool = True) -> None:
    """Loss, backward and zeroed gradients of one row; ``chunk_size=None``: the trainer's default of each path."""
    if fused:
        loss, _ = packed_grpo_loss(model, row, 1.0, LossConfig(), row.num_trained, chunk_size or FUSED_CHUNK_SIZE)
    else:
        logps = forward_packed(model, row, temperature=1.0, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE)
        loss, _ = grpo_loss(logps, row, LossConfig(), num_trained_global=row.num_trained)
    loss.backward()
    model.zero_grad(set_to_none=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def fused_correctness(model: Qwen3ForCausalLM, row: PackedRow, device: str) -> None:
    """packed_grpo_loss against forward_packed + grpo_loss on ``model``: loss, stats, every gradient."""
    g = torch.Generator(device=device).manual_seed(0)
    T, V = row.num_trained, model.config.vocab_size
    with torch.no_grad():  # sampler log-probs around the model's: ratios on both sides of the masks
        truth = forward_packed(model, row, 0.9).logp
    row = dataclasses.replace(
        row, sampler_logprobs=truth + 0.3 * torch.randn(T, device=device, generator=g),
        sampler_topk_ids=torch.randint(0, V, (T, 4), device=device, generator=g),
        sampler_topk_logprobs=-torch.rand(T, 4, device=device, generator=g) * 3 - 3,
        sampler_topk_valid=torch.ones(T, 4, dtype=torch.bool, device=device),
    )
    for cfg in (LossConfig(clip_min=0.7, clip_max=1.6), LossConfig(score_centering=False)):
        ref_loss, ref_stats = grpo_loss(forward_packed(model, row, 0.9, chunk_size=128), row, cfg, row.num_trained)
        ref_loss.backward()
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        loss, stats = packed_grpo_loss(model, row, 0.9, cfg, row.num_trained, chunk_size=128)
        loss.backward()
        grad_err = max(rel_err(p.grad, q) for p, q in zip(model.parameters(), ref, strict=True))
        stat_err = max(abs(stats[k] - ref_stats[k]).item() / max(abs(ref_stats[k]).item(), 1e-6) for k in stats)
        model.zero_grad(set_to_none=True)
        print(f"fused ({'score centering' if cfg.score_centering else 'clipped'}, float32): loss {loss.item():.6f} vs "
              f"{ref_loss.item():.6f}, max relative stat error {stat_err:.1e}, max relative grad error {grad_err:.1e}",
              flush=True)
    # The head alone in bf16 at the real vocabulary, with top-k / top-p candidate sets on half the tokens.
    T, D, V, K, M = 2048, 1024, QWEN3_06B["vocab_size"], 8, 64
    head = torch.nn.Linear(D, V, bias=False, device=device, dtype=torch.bfloat16)
    hidden = (torch.randn(T, D, device=device, generator=g) * 2).bfloat16().requires_grad_()
    cand_valid = torch.rand(T, M, device=device, generator=g) < 0.5
    cand_valid[::2] = False
    bf_row = dataclasses.replace(
        PackedRow.empty().to(device), pred_index=torch.arange(T, device=device),
        target_ids=torch.randint(0, V, (T,), device=device, generator=g),
        advantages=torch.randn(T, device=device, generator=g),
        sampler_topk_ids=torch.randint(0, V, (T, K), device=device, generator=g),
        sampler_topk_logprobs=-torch.rand(T, K, device=device, generator=g) * 3 - 2,
        sampler_topk_valid=torch.ones(T, K, dtype=torch.bool, device=device),
        candidate_ids=torch.randint(0, V, (T, M), device=device, generator=g), candidate_valid=cand_valid,
        token_sample=torch.zeros(T, dtype=torch.long, device=device), sample_group_ids=(0,),
    )
    bf_row.target_ids[1::2] = bf_row.candidate_ids[1::2, 0]
    bf_row.candidate_valid[1::2, 0] = True
    with torch.no_grad():
        truth = logprobs_from_hidden(hidden, head, bf_row, 1.0).logp
    bf_row = dataclasses.replace(bf_row, sampler_logprobs=truth + 0.3 * torch.randn(T, device=device, generator=g))
    cfg = LossConfig()
    ref_loss, _ = grpo_loss(logprobs_from_hidden(hidden, head, bf_row, 1.0), bf_row, cfg, T)
    ref = torch.autograd.grad(ref_loss, [hidden, head.weight])
    loss, _ = head_loss_from_hidden(hidden, head, bf_row, 1.0, lambda lp, r: _token_losses(lp, r, cfg), T)
    got = torch.autograd.grad(loss, [hidden, head.weight])
    print(f"fused head, bf16, vocabulary {V}: loss {loss.item():.6f} vs {ref_loss.item():.6f}; relative grad error "
          f"hidden {rel_err(got[0], ref[0]):.1e}, weight {rel_err(got[1], ref[1]):.1e}", flush=True)


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
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        fused_correctness(model, row, device)


def step_flops(rows: list[PackedRow], spec: dict, head_matmuls: int) -> float:
    """FLOPs of the fwd+bwd step by a simple model: every matmul once forward, once recomputed
    (checkpointing) and twice backward; attention per allowed query-key pair; LM head per trained
    token, ``head_matmuls`` times (4 unfused, 3 fused)."""
    d, head_dim = spec["hidden_size"], spec["head_dim"]
    q_dim, kv_dim = spec["num_attention_heads"] * head_dim, spec["num_key_value_heads"] * head_dim
    layer_params = 2 * d * q_dim + 2 * d * kv_dim + 3 * d * spec["intermediate_size"]
    per_token = 2 * spec["num_hidden_layers"] * layer_params * 4
    per_pair = spec["num_hidden_layers"] * 2 * (2 * q_dim) * 4  # q.k and p.v
    per_trained = 2 * d * spec["vocab_size"] * head_matmuls
    return sum(
        r.num_unique_tokens * per_token + r.attention_cost * per_pair + r.num_trained * per_trained for r in rows
    )


def throughput(spec: dict, shapes: list[Shape], budget: int, device: str, repeats: int) -> list[str]:
    """Plain and tree packing of each shape, timed alternately (best of ``repeats``), fused and unfused loss."""
    model = enable_tree_attention(make_model(spec, torch.bfloat16, device, checkpointing=True))
    lines = []
    for shape in shapes:
        samples = grpo_samples(shape, spec["vocab_size"])
        rows = {share: [r.to(device) for r in plan(samples, budget, share)] for share in (False, True)}
        m = batch_metrics(rows[True], budget)
        ratio = m["batch/packing_ratio"]
        for fused in (True, False):
            step = lambda r, fused=fused: train_step(model, r, fused=fused)  # noqa: E731
            for r in {r.num_unique_tokens: r for share in rows for r in rows[share]}.values():  # compile each length
                print(f"  warm-up {r.num_unique_tokens} tokens: {sync_time(lambda r=r: step(r), device):.1f}s")
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(repeats):
                for share in (False, True):
                    times[share].append(sum(sync_time(lambda r=r: step(r), device) for r in rows[share]))
            result = {}
            for share in (False, True):
                trained = sum(r.num_trained for r in rows[share])
                forwarded = sum(r.num_unique_tokens for r in rows[share])
                best = min(times[share])
                result[share] = (trained / best, forwarded / best, step_flops(rows[share], spec, 3 if fused else 4))
                print(f"  {shape.name} fused={fused} share={share}: {len(rows[share])} rows, {trained} trained, "
                      f"{forwarded} forwarded, best {best:.3f}s of {[round(t, 3) for t in times[share]]}", flush=True)
            (plain_tps, plain_fps, plain_flops), (tree_tps, tree_fps, tree_flops) = result[False], result[True]
            lines.append(
                f"| {shape.name} | {'fused' if fused else 'unfused'} | {ratio:.2f} | "
                f"{m['batch/samples_per_row']:.1f} | "
                f"{len(rows[False])} / {len(rows[True])} | {plain_tps:,.0f} | {tree_tps:,.0f} | "
                f"{tree_tps / plain_tps:.2f}x | {tree_tps / plain_tps / ratio:.2f} | {plain_flops / tree_flops:.2f}x | "
                f"{plain_fps:,.0f} / {tree_fps:,.0f} |"
            )
    return lines


def head(device: str, repeats: int, tokens: int = 9600, chunk_size: int = 512) -> list[str]:
    """The LM head + loss alone from bf16 hidden states: fused, unfused, and its matmuls alone."""
    D, V = QWEN3_06B["hidden_size"], QWEN3_06B["vocab_size"]
    if device != "cuda":
        D, V, tokens = TINY["hidden_size"], TINY["vocab_size"], 256
    g = torch.Generator(device=device).manual_seed(0)
    lm_head = torch.nn.Linear(D, V, bias=False, device=device, dtype=torch.bfloat16)
    hidden = torch.randn(tokens, D, device=device, generator=g).bfloat16().requires_grad_()
    ids = torch.randint(0, V, (tokens,), device=device, generator=g)
    seq = TrainingSequence([0, *ids.tolist()], [0] + [1] * tokens, [0.0] + [-2.0] * tokens)
    row = build_row([TrainingSample(seq, advantage=1.0, group_id=0, policy_version=0)]).to(device)
    row = dataclasses.replace(row, pred_index=torch.arange(tokens, device=device))
    cfg = LossConfig()

    def fused() -> None:
        loss, _ = head_loss_from_hidden(hidden, lm_head, row, 1.0, lambda lp, r: _token_losses(lp, r, cfg), tokens)
        loss.backward()

    def unfused() -> None:
        grpo_loss(logprobs_from_hidden(hidden, lm_head, row, 1.0, chunk_size), row, cfg, tokens)[0].backward()

    def matmuls() -> None:  # forward, grad of the input, grad of the weight: the fused path's 3 per chunk
        with torch.no_grad():
            for start in range(0, tokens, chunk_size):
                h = hidden[start:start + chunk_size]
                logits = h @ lm_head.weight.T
                _ = logits @ lm_head.weight, logits.T @ h

    lines = []
    for name, fn in (("fused", fused), ("unfused", unfused), ("3 matmuls only", matmuls)):
        fn()  # warm-up (compiles)
        best = min(sync_time(fn, device) for _ in range(repeats))
        hidden.grad = lm_head.weight.grad = None
        lines.append(f"| {name} | {tokens} | {best * 1e3:.1f} | {best * 1e6 / tokens:.2f} |")
        print(lines[-1], flush=True)
    print("fused head kernels:\n" + "\n".join(kernel_table(fused, device, top=15)), flush=True)
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
        chunks = (256, 512, 1024) if checkpointing else (DEFAULT_CHUNK_SIZE,)
        fused_chunks = (512, 1024, 1536, 2048, 4096) if checkpointing else (FUSED_CHUNK_SIZE,)
        variants += [(f"chunked ({c})", lambda c=c: train_step(model, row, c, fused=False)) for c in chunks]
        variants += [(f"fused ({c})", lambda c=c: train_step(model, row, c)) for c in fused_chunks]
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
        model = None  # frees it before the next one is built
    return lines


def measured_peak(device: str, n: int = 8192, repeats: int = 10) -> float:
    """bf16 matmul FLOP/s of an ``n``-cubed product on random data (mean of ``repeats`` after 3 warm-ups)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    seconds = sync_time(lambda: [a @ b for _ in range(repeats)], device)
    return 2 * n**3 * repeats / seconds


def varying_rows(vocab: int, steps: int, budget: int, seed: int = 0, scale: int = 1) -> list[PackedRow]:
    """A realistic sequence of one-row steps whose length changes every step: GRPO groups of a
    600-1400-token prompt and 8 completions of 100-500 tokens each (lengths divided by ``scale``), as
    many groups as fit ``budget``."""
    rng, rows = random.Random(seed), []
    for _ in range(steps):
        samples: list[TrainingSample] = []
        tokens = 0
        for g in range(16):
            shape = Shape("", 1, rng.randrange(600 // scale, 1400 // scale), 8, 0)
            lengths = [rng.randrange(100 // scale, 500 // scale) for _ in range(shape.completions)]
            if tokens + shape.prompt + sum(lengths) > budget:
                break
            tokens += shape.prompt + sum(lengths)
            prompt = [rng.randrange(vocab) for _ in range(shape.prompt)]
            for n in lengths:
                seq = TrainingSequence(prompt + [rng.randrange(vocab) for _ in range(n)], [0] * shape.prompt + [1] * n,
                                       [0.0] * shape.prompt + [-2.0] * n)
                samples.append(TrainingSample(seq, advantage=rng.uniform(-1, 1), group_id=g, policy_version=0))
        rows.append(build_row(samples))
    return rows


COMPILE_MODES = ("eager", "compiled", "static")


def compiled_step(names: list[str], steps: int, budget: int, device: str, scale: int = 1,
                  modes: tuple[str, ...] = ("eager", "compiled"), bucket: int = 1024,
                  chunk: int | None = None) -> list[str]:
    """Eager and compiled (``compile_decoder_layers``) fused steps over the same ``varying_rows``,
    no warm-up per length: hardware FLOP utilisation (HFU: recomputation included, ``step_flops``)
    and MFU (``trainer.training.flops``) against the measured bf16 peak; compile stalls counted.
    ``static`` (a mode to compare): layers compiled with static shapes, rows padded up to a multiple
    of ``bucket`` tokens (one compilation per bucket; the padding's FLOPs are not counted). ``chunk``:
    the LM-head chunk (``None``: the trainer's)."""
    from trainer.training.compile import CompileTracker, compile_decoder_layers
    from trainer.training.flops import FlopModel, row_flops

    peak = measured_peak(device, n=8192 if device == "cuda" else 512)
    print(f"measured bf16 peak: {peak / 1e12:.0f} TFLOP/s", flush=True)
    lines = []
    for name in names:
        spec = QWEN3.get(name, TINY)  # any other name: the tiny model (--tiny)
        rows = [r.to(device) for r in varying_rows(spec["vocab_size"], steps, budget, scale=scale)]
        for mode in modes:
            model = enable_tree_attention(make_model(spec, torch.bfloat16, device, checkpointing=True))
            flop_model = FlopModel.from_config(model.config)
            if mode != "eager":
                # Every model's layers share one code object, and dynamo's recompile limit (8) counts
                # per code object: without a reset, one mode's graphs would crowd out the next's.
                torch._dynamo.reset()
                compile_decoder_layers(model, dynamic=mode == "compiled")
            run_rows = [r.padded_to_multiple(bucket) for r in rows] if mode == "static" else rows
            tracker = CompileTracker(announce=False)
            times, compiles = [], []
            for row in run_rows:
                times.append(sync_time(lambda row=row: train_step(model, row, chunk), device))
                compiles.append(tracker.take())
            tracker.close()
            print(f"  {name} {mode}: {tracker.total_count} compilations, {tracker.graphs} graphs, "
                  f"{tracker.total_s:.1f} s compiling", flush=True)
            steady = [i for i, (_, count) in enumerate(compiles) if count == 0 and i > 0]
            secs = sum(times[i] for i in steady)
            hfu = sum(step_flops([rows[i]], spec, 3) for i in steady) / secs / peak
            mfu = sum(row_flops(flop_model, rows[i]) for i in steady) / secs / peak
            tps = sum(rows[i].num_unique_tokens for i in steady) / secs
            stalls = [round(t, 1) for t, (_, c) in zip(times, compiles, strict=True) if c]
            lines.append(f"| {name} | {mode} | {len(rows)} | {min(r.num_unique_tokens for r in rows)}-"
                         f"{max(r.num_unique_tokens for r in rows)} | {hfu:.1%} | {mfu:.1%} | {tps:,.0f} | "
                         f"{sum(c for _, c in compiles)} | {stalls} | {sum(times):.1f} |")
            print(lines[-1], [round(t, 3) for t in times], flush=True)
            model = None  # frees it before the next one is built
            if device == "cuda":
                torch.cuda.empty_cache()
    return lines


def largest(names: list[str], tokens: int, device: str) -> list[str]:
    """Full-parameter AdamW steps on one ``tokens``-token row: bf16 weights and optimizer state
    (``dtype="bfloat16"``), and float32 master weights with bf16 autocast (the default ``dtype``)."""
    lines = []
    seq = TrainingSequence(list(range(tokens)), [0] + [1] * (tokens - 1), [0.0] + [-2.0] * (tokens - 1))
    for name in names:
        for dtype in (torch.bfloat16, torch.float32):
            model = opt = None
            try:
                model = enable_tree_attention(make_model(QWEN3.get(name, TINY), dtype, device, checkpointing=True))
                row = build_row([TrainingSample(seq, advantage=1.0, group_id=0, policy_version=0)]).to(device)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
                params = sum(p.numel() for p in model.parameters())

                def step() -> None:
                    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.float32):
                        loss, _ = packed_grpo_loss(model, row, 1.0, LossConfig(), row.num_trained)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                step()
                gib, seconds = peak_memory(step, device)
                lines.append(f"| {name} | {params / 1e9:.2f}B | {str(dtype)[6:]} | {tokens} | {gib:.1f} "
                             f"| {seconds:.2f} |")
            except torch.OutOfMemoryError:
                lines.append(f"| {name} | | {str(dtype)[6:]} | {tokens} | OOM | |")
            print(lines[-1], flush=True)
            model = opt = None  # free this step's memory before the next shape
            torch.cuda.empty_cache()
    return lines


def kernel_table(step: Callable[[], None], device: str, top: int = 25) -> list[str]:
    """Table rows of the kernels (CPU ops off CUDA) of one call of ``step``, by total time."""
    activity = torch.profiler.ProfilerActivity.CUDA if device == "cuda" else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        step_s = sync_time(step, device)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA] or list(
        prof.key_averages()
    )
    times = [(e.self_device_time_total if device == "cuda" else e.self_cpu_time_total, e) for e in events]
    times.sort(key=lambda t: t[0], reverse=True)
    total = sum(us for us, _ in times)
    lines = [f"| (wall {step_s * 1e3:.1f} ms, kernels {total / 1e3:.1f} ms) | | | |"]
    lines += [f"| {e.key[:90]} | {e.count} | {us / 1e3:.1f} | {100 * us / total:.1f} |" for us, e in times[:top]]
    return lines


def profile(spec: dict, shape: Shape, budget: int, device: str, compiled: bool = False) -> list[str]:
    """The kernels of one fused tree-packed step (the first row of ``shape``), by total time."""
    from trainer.training.compile import compile_decoder_layers

    model = enable_tree_attention(make_model(spec, torch.bfloat16, device, checkpointing=True))
    if compiled:
        compile_decoder_layers(model)
    row = plan(grpo_samples(shape, spec["vocab_size"]), budget, share=True)[0].to(device)
    train_step(model, row)  # compile
    print(f"profile: {row.num_unique_tokens} tokens, {row.num_trained} trained", flush=True)
    return kernel_table(lambda: train_step(model, row), device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and samples (CPU smoke test)")
    parser.add_argument("--sections", default="correctness,throughput,head,memory,profile")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="0.6B,1.7B,4B", help="Qwen3 shapes of the compiled section")
    parser.add_argument("--largest", default="8B,14B", help="Qwen3 shapes of the largest section")
    parser.add_argument("--steps", type=int, default=12, help="rows of the compiled section's sequence")
    parser.add_argument("--profile-compiled", action="store_true", help="profile the compiled step")
    parser.add_argument("--modes", default="eager,compiled", help=f"steps of the compiled section: {COMPILE_MODES}")
    parser.add_argument("--bucket", type=int, default=1024, help="row-length multiple of the 'static' mode")
    parser.add_argument("--chunk", type=int, default=None, help="LM-head chunk of the compiled section "
                        "(default: the trainer's, FUSED_CHUNK_SIZE)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sections = args.sections.split(",")
    spec = TINY if args.tiny else QWEN3_06B
    if args.tiny:
        args.models = args.largest = "tiny"
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
                    "| shape | loss | packing ratio | samples/row | rows plain / tree | plain trained tok/s "
                    "| tree trained tok/s | speedup | speedup / ratio | FLOP-model speedup "
                    "| forwarded tok/s plain / tree |\n" + "|---" * 11 + "|\n" + "\n".join(rows)
                )
            elif name == "head":
                rows = head(device, args.repeats)
                tables.append("| LM head + loss | trained tokens | best ms | us / token |\n|---|---|---|---|\n"
                              + "\n".join(rows))
            elif name == "compiled":
                rows = compiled_step(args.models.split(","), args.steps, budget, device, scale,
                                     tuple(args.modes.split(",")), args.bucket, args.chunk)
                tables.append("| Qwen3 | step | rows | tokens/row | HFU | MFU | forwarded tok/s | compilations "
                              "| compile stalls s | total s |\n" + "|---" * 10 + "|\n" + "\n".join(rows))
            elif name == "largest":
                rows = largest(args.largest.split(","), mem_tokens, device)
                tables.append("| Qwen3 | params | weights + AdamW state | row tokens | peak GiB | step s |\n"
                              "|---|---|---|---|---|---|\n" + "\n".join(rows))
            elif name == "profile":
                rows = profile(spec, shapes[0], budget, device, compiled=args.profile_compiled)
                tables.append("| kernel | calls | ms | % |\n|---|---|---|---|\n" + "\n".join(rows))
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
