"""``packing="per_sample"``: the way out for families tree packing refuses. Rows share nothing and each
sample is forwarded on its own by the model's own layers (a right-padded batch): log-probs and every
gradient equal each sample forwarded alone, for a short-convolution (LFM2), a Mamba2 hybrid (Granite
MoE hybrid) and an attention-sink (gpt-oss) model, all built locally."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import (
    AutoTokenizer,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    PreTrainedModel,
)

from tests.trainer.training.test_tree_attention import SMALL, TEMPERATURE, random_groups, reference_logprobs
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import ConfigError, UnsupportedModelError
from trainer.training.batching import MicroBatch
from trainer.training.logprobs import forward_packed
from trainer.training.packing import PackedRow, build_row
from trainer.training.row_forward import SampleBatchLayout, row_hidden_states
from trainer.training.tree_attention import enable_tree_attention


def short_conv() -> Lfm2ForCausalLM:
    torch.manual_seed(0)
    return Lfm2ForCausalLM(Lfm2Config(**SMALL, num_hidden_layers=2, layer_types=["conv", "full_attention"]))


def mamba_hybrid() -> GraniteMoeHybridForCausalLM:
    torch.manual_seed(0)
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **SMALL, num_hidden_layers=2, layer_types=["mamba", "attention"], num_local_experts=0,
        mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8,
    ))


def attention_sinks() -> GptOssForCausalLM:
    torch.manual_seed(0)
    return GptOssForCausalLM(GptOssConfig(
        **SMALL, num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )).float()


MODELS = {"lfm2 short conv": short_conv, "granite mamba2": mamba_hybrid, "gpt-oss sinks": attention_sinks}


@pytest.mark.parametrize("build", MODELS.values(), ids=MODELS.keys())
def test_tree_packing_refuses_and_names_the_way_out(build: Any) -> None:
    with pytest.raises(UnsupportedModelError, match=r"packing='per_sample'"):
        enable_tree_attention(build())


@pytest.mark.parametrize("build", MODELS.values(), ids=MODELS.keys())
def test_per_sample_rows_match_each_sample_alone(build: Any) -> None:
    reference: PreTrainedModel = build()
    model = copy.deepcopy(reference)
    samples = random_groups(0)  # samples of very different lengths: padding up to the longest
    row = build_row(samples, share_prefixes=False)
    assert row.num_unique_tokens == row.num_unpacked_tokens

    out = forward_packed(model, row, TEMPERATURE, chunk_size=16)
    weights = torch.randn(row.num_trained, generator=torch.Generator().manual_seed(0))
    finite = torch.isfinite(out.topk_logp)
    (weights @ out.logp + out.topk_logp[finite].sum()).backward()

    alone = [reference_logprobs(reference, smp, row, s) for s, smp in enumerate(samples)]
    ref_logp, ref_topk = (torch.cat(parts) for parts in zip(*alone, strict=True))
    torch.testing.assert_close(out.logp, ref_logp, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.topk_logp, ref_topk, rtol=0, atol=2e-5)
    (weights @ ref_logp + ref_topk[finite].sum()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:  # e.g. experts no token of either forward was routed to
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")  # noqa: B023


def test_layout_places_each_sample_in_its_own_batch_entry() -> None:
    samples = random_groups(1)[:3]
    row = build_row(samples, share_prefixes=False)
    layout = SampleBatchLayout.of(row)
    lengths = [len(s.sequence.input_ids) for s in samples]
    assert (layout.batch_size, layout.length) == (3, max(lengths))
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    for b, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        assert layout.flat_index[start:start + n].tolist() == list(range(b * layout.length, b * layout.length + n))


def test_a_row_that_shares_prefixes_is_not_forwarded_per_sample() -> None:
    row = build_row(random_groups(0))
    with pytest.raises(ValueError, match="shares prefixes needs tree attention"):
        row_hidden_states(short_conv(), row)


def zero_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Unused: the test calls training_step directly."""
    return [0.0] * len(completions)


def _trainer(model: Any, tiny_model_dir: Path, tmp_path: Path, **kwargs: Any) -> AsyncGRPOTrainer:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                           save_strategy="no", **kwargs)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    return AsyncGRPOTrainer(model=model, reward_funcs=zero_reward, args=args, train_dataset=data,
                            processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))


def test_the_advice_trains_a_refused_family(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Following the refusal's advice: the trainer takes the model, plans rows that share nothing,
    and a training step (gradient checkpointing on, the default) moves every trained parameter's gradient."""
    with pytest.raises(UnsupportedModelError, match="packing='per_sample'"):
        _trainer(short_conv(), tiny_model_dir, tmp_path / "tree")
    trainer = _trainer(short_conv(), tiny_model_dir, tmp_path / "per_sample", packing="per_sample")
    assert trainer.model.config._attn_implementation != "toolgym_tree"
    samples = random_groups(2)
    rng = random.Random(0)
    for s in samples:
        s.advantage = rng.uniform(-1, 1)
    row = build_row(samples, share_prefixes=False)
    trainer.current_gradient_accumulation_steps = 1
    batch = MicroBatch(rows=[row], num_trained_global=row.num_trained, num_samples=row.num_samples,
                       forwarded_tokens=row.num_unique_tokens, unpacked_tokens=row.num_unpacked_tokens)
    loss = trainer.training_step(trainer.model, batch)
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), [n for n, g in grads.items()
                                                                               if g is None or not g.any()]
    empty = trainer.training_step(trainer.model, MicroBatch(rows=[PackedRow.empty()], num_trained_global=0,
                                                            num_samples=0, forwarded_tokens=0, unpacked_tokens=0))
    assert float(empty) == 0.0


def test_packing_accepts_only_known_modes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="packing='padding_free' must be one of"):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, packing="padding_free")
