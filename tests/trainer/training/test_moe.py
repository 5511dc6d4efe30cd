"""``router_aux_loss_coef``: a tiny Mixture-of-Experts model (Qwen3-MoE, built locally) gets
coef x its load-balancing loss added to the packed loss, and the gradient reaches its routers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import ConfigError
from trainer.records import TrainingSample, TrainingSequence
from trainer.training.batching import MicroBatch
from trainer.training.packing import PackedRow, build_row

IDS = [3, 9, 14, 27, 5, 31, 8, 12, 40, 2]


def zero_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Unused: the tests call training_step directly."""
    return [0.0] * len(completions)


def _moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01,
                            max_position_embeddings=64)
    return Qwen3MoeForCausalLM(config)


def _trainer(model: Any, tiny_model_dir: Path, tmp_path: Path, coef: float | None,
             packing: str = "tree") -> AsyncGRPOTrainer:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", gradient_checkpointing=False,
                           disable_tqdm=True, save_strategy="no", router_aux_loss_coef=coef, packing=packing)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    return AsyncGRPOTrainer(model=model, reward_funcs=zero_reward, args=args, train_dataset=data,
                            processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))


def _batch(row: PackedRow) -> MicroBatch:
    return MicroBatch(rows=[row], num_trained_global=row.num_trained, num_samples=row.num_samples,
                      forwarded_tokens=row.num_unique_tokens, unpacked_tokens=row.num_unpacked_tokens)


def _row() -> PackedRow:
    mask = [0] * 4 + [1] * (len(IDS) - 4)
    logq = [0.0] * 4 + [-4.0] * (len(IDS) - 4)
    return build_row([TrainingSample(TrainingSequence(IDS, mask, logq), advantage=1.0, group_id=0, policy_version=0)])


def _step(trainer: AsyncGRPOTrainer, row: PackedRow) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.training_step(trainer.model, _batch(row))
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return float(loss), grads


def test_aux_loss_is_added_and_reaches_the_routers(tiny_model_dir: Path, tmp_path: Path) -> None:
    coef = 0.5
    with_aux = _trainer(_moe(), tiny_model_dir, tmp_path / "a", coef)
    without = _trainer(_moe(), tiny_model_dir, tmp_path / "b", 0.0)
    loss_a, grads_a = _step(with_aux, _row())
    loss_b, grads_b = _step(without, _row())
    aux = with_aux.metrics.flush()["aux_loss"]
    assert "aux_loss" not in without.metrics.flush()

    # One sample, no sharing: the tree mask is the causal mask, so the model's own aux loss of a
    # plain forward is the reference.
    reference = _moe()
    out = reference(input_ids=torch.tensor([IDS]), output_router_logits=True)
    expected = load_balancing_loss_func(out.router_logits, 4, 2)
    assert aux == pytest.approx(float(expected.detach()), rel=1e-5)
    assert loss_a - loss_b == pytest.approx(coef * aux, rel=1e-4)

    routers = [n for n in grads_a if ".gate." in n or n.endswith(".gate.weight")]
    assert routers, sorted(grads_a)
    for name in routers:
        assert not torch.allclose(grads_a[name], grads_b[name]), f"the aux loss does not reach {name}"


def test_per_sample_rows_balance_over_real_tokens_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    """packing="per_sample" forwards a padded batch: the routers also see its padding, which the
    load-balancing loss must not count. Reference: the samples' router logits, each forwarded alone."""
    trainer = _trainer(_moe(), tiny_model_dir, tmp_path, 0.5, packing="per_sample")
    first, second = IDS[:6] + [33, 7], IDS  # the first is padded: its padding comes before the second's tokens
    samples = [TrainingSample(TrainingSequence(ids, [0] * 4 + [1] * (len(ids) - 4), [-1.0] * len(ids)),
                              advantage=a, group_id=0, policy_version=0) for ids, a in ((first, 1.0), (second, -1.0))]
    _step(trainer, build_row(samples, share_prefixes=False))
    aux = trainer.metrics.flush()["aux_loss"]
    reference = _moe()
    layers = [reference(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
              for ids in (first, second)]
    expected = load_balancing_loss_func(tuple(torch.cat(pair) for pair in zip(*layers, strict=True)), 4, 2)
    assert aux == pytest.approx(float(expected.detach()), rel=1e-5)


def test_empty_row_adds_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(_moe(), tiny_model_dir, tmp_path, 0.5)
    loss, _ = _step(trainer, PackedRow.empty())
    assert loss == 0.0 and trainer.metrics.flush()["aux_loss"] == 0.0


def test_coefficient_defaults_to_the_model_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert _trainer(_moe(), tiny_model_dir, tmp_path, None)._aux_coef == 0.01


def test_dense_model_refuses_a_coefficient(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a Mixture-of-Experts model"):
        _trainer(str(tiny_model_dir), tiny_model_dir, tmp_path, 0.1)
