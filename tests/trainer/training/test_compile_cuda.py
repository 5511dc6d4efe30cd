"""The compiled training step (``trainer/training/compile.py``) on CUDA: same loss and gradients as
eager, and a bounded number of compilations when the row length changes at every step.

CUDA only (the step is compiled only there); CI has no GPU, so these run on the GPU machine, whose
image has torch and transformers but not the project's other dependencies (the training side needs
none of them; ``tests/test_layers.py`` checks it)::

    PYTHONPATH=. python3 -m pytest --noconftest -p no:cacheprovider -o addopts="" \
        tests/trainer/training/test_compile_cuda.py -q -s
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from trainer.records import TrainingSample, TrainingSequence
from trainer.training.compile import CompileTracker, RowBuckets, compile_decoder_layers
from trainer.training.loss import LossConfig, packed_grpo_loss
from trainer.training.packing import PackedRow, build_row
from trainer.training.tree_attention import enable_tree_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the compiled step is CUDA-only; run this file on the GPU machine")

VOCAB = 8192
# Compilations (stalls) of a fresh process over rows of 30 lengths, besides the decoder layers' own:
# the fused head loss's two compiled passes and FlexAttention's kernels, each possibly recompiled once
# when the length first changes (dynamo's automatic dynamic shapes). The layers compile once with
# dynamic shapes (one H200: once over 16 lengths, bench/packing/README.md), once per bucket with
# static shapes.
OTHER_COMPILATIONS = 7
BUCKET = 256


def _model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return enable_tree_attention(model)


def _row(seed: int, groups: int = 2) -> PackedRow:
    """A GRPO row: ``groups`` prompts of random length, 4 completions each of random lengths."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(60, 240))]
        for _ in range(4):
            n = rng.randrange(20, 120)
            ids = prompt + [rng.randrange(VOCAB) for _ in range(n)]
            mask = [0] * len(prompt) + [1] * n
            logq = [-9.0 * m for m in mask]  # about log(1/VOCAB): ratios near 1, every token trained
            samples.append(TrainingSample(TrainingSequence(ids, mask, logq), advantage=rng.uniform(-1, 1),
                                          group_id=g, policy_version=0))
    return build_row(samples).to("cuda")


def _step(model: torch.nn.Module, row: PackedRow) -> tuple[float, dict[str, torch.Tensor]]:
    loss, _ = packed_grpo_loss(model, row, 1.0, LossConfig(), row.num_trained)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_compiled_step_matches_eager(dynamic: bool) -> None:
    # bf16 rounding differs between the fused (compiled) and unfused (eager) kernels, so both are
    # measured against the same step in float32: the compiled step must be as close to it as eager is.
    torch._dynamo.reset()
    eager = _model()
    reference = copy.deepcopy(eager).float()
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled, dynamic=dynamic) == 4
    for seed in (0, 1):  # without eager's rounding (emulate_precision_casts) row 0 failed: 3x eager's error
        row = _row(seed)
        loss_r, grads_r = _step(reference, row)
        loss_e, grads_e = _step(eager, row)
        loss_c, grads_c = _step(compiled, row if dynamic else RowBuckets(BUCKET)(row))
        assert loss_c == pytest.approx(loss_e, rel=2e-3, abs=1e-4)
        assert loss_e != 0.0
        for name, g in grads_r.items():
            scale = g.norm().clamp_min(1e-12)
            err_eager = float((grads_e[name] - g).norm() / scale)
            err_compiled = float((grads_c[name] - g).norm() / scale)
            assert err_compiled <= 1.25 * err_eager + 2e-3, (
                f"row {seed}, {name}: compiled is {err_compiled:.3g} from float32, eager {err_eager:.3g}")


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static buckets"])
def test_thirty_row_lengths_compile_a_bounded_number_of_times(dynamic: bool) -> None:
    torch._dynamo.reset()  # as in a fresh process: the other tests' compilations must not be reused here
    model = _model()
    compile_decoder_layers(model, dynamic=dynamic)
    buckets = RowBuckets(BUCKET)
    tracker = CompileTracker(announce=False)
    try:
        lengths = set()
        for seed in range(30):
            row = _row(100 + seed, groups=1 + seed % 3)
            lengths.add(row.num_unique_tokens)
            _step(model, row if dynamic else buckets(row))
        _, count = tracker.take()
    finally:
        tracker.close()
    layer_graphs = 1 if dynamic else len(buckets.lengths)
    print(f"{'dynamic' if dynamic else f'buckets of {BUCKET}'}: {len(lengths)} row lengths"
          f"{'' if dynamic else f' in {len(buckets.lengths)} buckets'}: {count} compilations "
          f"({tracker.graphs} graphs), {tracker.total_s:.1f} s compiling")
    assert len(lengths) == 30
    assert 1 <= count <= layer_graphs + OTHER_COMPILATIONS
