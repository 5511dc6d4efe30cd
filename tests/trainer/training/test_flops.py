"""The FLOP model and peak table behind ``perf/fwd_bwd_mfu`` (``trainer/training/flops.py``)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from trainer.records import TrainingSample, TrainingSequence
from trainer.training import flops
from trainer.training.flops import FlopModel, matmul_dtype, peak_flops, row_flops
from trainer.training.packing import build_row


def _qwen3() -> Qwen3Config:
    return Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _sample(ids: list[int], trained_from: int, group: int = 0) -> TrainingSample:
    mask = [0] * trained_from + [1] * (len(ids) - trained_from)
    return TrainingSample(TrainingSequence(ids, mask, [0.0] * len(ids)), advantage=1.0, group_id=group,
                          policy_version=0)


def test_flops_per_token_pair_and_trained_token() -> None:
    model = FlopModel.from_config(_qwen3())
    attn = 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2  # q, o and k, v projections
    assert model.per_token == 2 * 2 * (attn + 3 * 64 * 192)
    assert model.per_pair == 4 * 2 * 4 * 16
    assert model.per_trained == 2 * 64 * 1000


def test_row_flops_count_the_trees_pairs_and_trained_tokens() -> None:
    model = FlopModel.from_config(_qwen3())
    # Two samples sharing a 3-token prompt; the branch point's token is held once per branch (its two
    # targets differ), so 8 tokens are forwarded, at depths 0 1 2 3 4 | 2 3 4.
    row = build_row([_sample([5, 6, 7, 8, 9], 3), _sample([5, 6, 7, 10, 11], 3)])
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    pairs = 27  # each token sees its own path, depth + 1 keys: not the 36 of a causal 8-token row
    assert row.attention_cost == pairs == int((row.position_ids + 1).sum())
    tokens = row.num_unique_tokens
    expected = 3 * (model.per_token * tokens + model.per_pair * pairs + model.per_trained * row.num_trained)
    assert row_flops(model, row) == expected


def test_moe_counts_the_routed_experts() -> None:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=192, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16)
    dense = FlopModel.from_config(_qwen3())
    moe = FlopModel.from_config(config)
    attn_flops = dense.per_token - 2 * 2 * 3 * 64 * 192
    assert moe.per_token == attn_flops + 2 * 2 * (3 * 64 * 32 * 2 + 64 * 8)


def test_unknown_architecture_gives_none_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import GPT2Config

    flops._warned.clear()
    with caplog.at_level(logging.WARNING):
        assert FlopModel.from_config(GPT2Config()) is None
    assert "model_type='gpt2'" in caplog.text
    assert FlopModel.from_config(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4)) is not None


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA A100-SXM4-80GB", "float16", 312e12),
    ("NVIDIA B200", "bfloat16", 2250e12),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
])
def test_peak_by_device_and_dtype(name: str, dtype: str, peak: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), dtype) == peak


@pytest.mark.parametrize("name, dtype, reason", [
    ("NVIDIA GeForce RTX 4090", "bfloat16", "is not known"),
    ("NVIDIA B200", "float32", "no float32 peak"),
])
def test_unknown_peak_is_absent_with_a_warning(name: str, dtype: str, reason: str, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    flops._warned.clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    with caplog.at_level(logging.WARNING):
        assert peak_flops(torch.device("cuda", 0), dtype) is None
    assert reason in caplog.text
    flops._warned.clear()
    with caplog.at_level(logging.WARNING):
        assert peak_flops(torch.device("cpu"), "bfloat16") is None


def test_matmul_dtype_follows_mixed_precision() -> None:
    assert matmul_dtype(torch.float32, "bf16") == "bfloat16"
    assert matmul_dtype(torch.float32, "fp16") == "float16"
    assert matmul_dtype(torch.bfloat16, "no") == "bfloat16"
