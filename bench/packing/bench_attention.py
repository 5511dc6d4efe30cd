"""Tree attention alone: compiled FlexAttention on a GRPO tree row, kernel options against each other.

Command (on the GPU machine, from the repository root)::

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/packing/bench_attention.py

The compiled 0.6B training step spends 43 % of its kernel time in FlexAttention on the tree mask
(``bench/packing/README.md``). This script times that attention alone (forward + backward, bf16,
head dim 128, GQA) on the row ``bench_packing`` trains (4 groups of prompt 1000 + 8 x 300 tokens,
13,600 tokens) and reports TFLOP/s over the *allowed* query-key pairs (4 x d FLOPs per pair forward,
10 x d backward: the five products of the flash backward), for each set of ``kernel_options``
(``--variants``), against the same FlexAttention on a plain causal mask and cuDNN/flash SDPA (causal)
of the same length: what the hardware gives attention of this size; and the tree mask with the
mask function the trainer had before (three index reads per element against one).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from bench.packing.bench_packing import Shape, grpo_samples, plan
from trainer.training.tree_attention import flex_tree_mask

VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "tma": {"USE_TMA": True},
    "fwd128x128": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    "bwd64x128w8": {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 8,
                    "num_stages": 3},
    "bwd64x64w4": {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_warps": 4,
                   "num_stages": 3},
    "bwd32x128w4": {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_warps": 4,
                    "num_stages": 3},
}


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (CUDA events), after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def allowed_pairs(enter: torch.Tensor, leave: torch.Tensor) -> int:
    """Query-key pairs of the tree mask: key ``k`` is seen by the ``leave[k] - k`` queries ``[k, leave[k])``."""
    return int((leave - enter).sum())


def three_index_mask(tree: BlockMask, enter: torch.Tensor, leave: torch.Tensor) -> BlockMask:
    """``tree``'s blocks with the mask function ``flex_tree_mask`` had before: the interval test
    ``enter[kv] <= enter[q] < leave[kv]`` reading three indices per element instead of one."""
    n = enter.numel()
    pad = -n % tree.BLOCK_SIZE[0]
    enter = torch.cat([enter, enter.new_full((pad,), n + pad)])
    leave = torch.cat([leave, leave.new_zeros(pad)])

    def mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (enter[kv] <= enter[q]) & (enter[q] < leave[kv])

    return BlockMask.from_kv_blocks(tree.kv_num_blocks, tree.kv_indices, tree.full_kv_num_blocks,
                                    tree.full_kv_indices, BLOCK_SIZE=tree.BLOCK_SIZE, mask_mod=mod,
                                    seq_lengths=(n, n))


def fwd_bwd(attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            grad: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--heads", default="16/8,32/8", help="query/kv heads of the shapes (0.6B-1.7B, 4B)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    row = plan(grpo_samples(Shape("prompt 1000 + 8 x 300", 4, 1000, 8, 300), 1000), 16384, True)[0].to("cuda")
    n, d = row.num_unique_tokens, 128
    pairs = allowed_pairs(row.dfs_enter, row.dfs_leave)
    print(f"row: {n} tokens, {pairs / 1e6:.1f}M allowed pairs ({pairs / (n * (n + 1) / 2):.1%} of causal); "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    tree = flex_tree_mask(row.dfs_enter, row.dfs_leave)
    three_index = three_index_mask(tree, row.dfs_enter, row.dfs_leave)
    causal = create_block_mask(lambda b, h, q, k: q >= k, None, None, n, n, device="cuda")
    lines = []
    for heads in args.heads.split(","):
        hq, hkv = (int(x) for x in heads.split("/"))
        q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
        flops_tree = 14 * d * hq * pairs
        flops_causal = 14 * d * hq * n * (n + 1) // 2

        def report(label: str, seconds: float, flops: int) -> None:
            line = f"| {hq}/{hkv} | {label} | {seconds * 1e3:.2f} | {flops / seconds / 1e12:.0f} |"
            print(line, flush=True)
            lines.append(line)

        for name in args.variants.split(","):
            options = dict(VARIANTS[name])
            compiled = torch.compile(flex_attention, dynamic=False)
            try:
                t0 = time.perf_counter()
                def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: dict = options, c=compiled,
                           t=tree) -> torch.Tensor:
                    return c(q, k, v, block_mask=t, enable_gqa=True, kernel_options=o or None)

                step = fwd_bwd(attend, q, k, v, grad)
                step()
                torch.cuda.synchronize()
                print(f"  {name}: compiled in {time.perf_counter() - t0:.1f}s", flush=True)
                report(f"flex tree, {name}", timed(step, args.repeats), flops_tree)
            except Exception as e:  # noqa: BLE001  (an option set this torch refuses: keep the others)
                print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=False)
        report("flex tree, three-index mask function (before 2026-12-03)",
               timed(fwd_bwd(lambda q, k, v: compiled(q, k, v, block_mask=three_index, enable_gqa=True), q, k, v,
                             grad), args.repeats), flops_tree)
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=False)
        report("flex causal, default", timed(fwd_bwd(lambda q, k, v: compiled(q, k, v, block_mask=causal,
                                                                                  enable_gqa=True), q, k, v, grad),
                                             args.repeats), flops_causal)
        torch._dynamo.reset()
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
            try:
                with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, backend)):
                    step = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                  enable_gqa=True), q, k, v, grad)
                    report(f"SDPA causal, {backend}", timed(step, args.repeats), flops_causal)
            except Exception as e:  # noqa: BLE001
                print(f"  SDPA {backend}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    print("\n| heads q/kv | attention | fwd+bwd ms | TFLOP/s |\n|---|---|---|---|\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
