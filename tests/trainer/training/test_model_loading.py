"""Vision-language checkpoints train text-only: the vision tower is frozen, has no optimizer state, is not synced."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from tests.trainer.training.test_tree_attention import random_sample
from toolgym.kit.tiny_model import build_tiny_model
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import ConfigError
from trainer.rollout.chat_template import refuse_image_parts
from trainer.sync.weight_sync import check_against_manifest
from trainer.training.loss import LossConfig, packed_grpo_loss
from trainer.training.packing import build_row


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-vl") / "model", arch="qwen3_5_vl")


def _trainer(model_dir: Path, tmp_path: Path) -> AsyncGRPOTrainer:
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), learning_rate=1e-3, bf16=False, report_to=[],
                           gradient_checkpointing=False)
    prompts = Dataset.from_list([{"prompt": [{"role": "user", "content": "Count to three."}]}])
    return AsyncGRPOTrainer(str(model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                            args=args, train_dataset=prompts)


def test_only_the_language_model_trains_and_is_synced(tiny_vl_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(tiny_vl_dir, tmp_path)
    model = trainer.model
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    vision = {n for n, _ in model.named_parameters() if n.startswith("model.visual.")}
    assert vision and trainer._frozen_weights == vision
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in vision)

    optimizer = trainer.create_optimizer()
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    by_name = dict(model.named_parameters())
    assert not in_optimizer & {id(by_name[n]) for n in vision}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = random.Random(0)
    vocab = model.config.text_config.vocab_size
    for _ in range(3):  # a short run of the trainer's loss and optimizer on tree-packed rows
        prompt = [rng.randrange(vocab) for _ in range(8)]
        samples = [random_sample(rng, prompt + [rng.randrange(vocab) for _ in range(6)], 8, 0) for _ in range(3)]
        row = build_row(samples)
        loss, _ = packed_grpo_loss(model, row, 1.0, LossConfig(), row.num_trained)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == (name not in vision), f"{name}: changed={changed}"
    assert not any(state for p, state in optimizer.state.items() if id(p) in {id(by_name[n]) for n in vision})

    sent = trainer._policy_sync.policy_weights()
    assert not {n for n, _ in sent} & vision
    assert {n for n, _ in sent} == set(by_name) - vision
    check_against_manifest(sent, trainer._policy_sync.manifest())  # the checkpoint's names, less the vision tower's


def test_image_parts_are_refused_before_the_server(tiny_vl_dir: Path, tmp_path: Path) -> None:
    image = [{"role": "user", "content": [{"type": "image", "url": "cat.png"}, {"type": "text", "text": "What?"}]}]
    with pytest.raises(ConfigError, match="images are not supported yet"):
        refuse_image_parts(image)
    refuse_image_parts([{"role": "user", "content": [{"type": "text", "text": "What?"}]}])
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), bf16=False, report_to=[])
    with pytest.raises(ConfigError, match="images are not supported yet"):
        AsyncGRPOTrainer(str(tiny_vl_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                         args=args, train_dataset=Dataset.from_list([{"prompt": image}]))


def test_the_sync_sends_fused_moe_experts_by_their_checkpoint_names(tmp_path: Path) -> None:
    """transformers 5 fuses a MoE layer's experts on load; the sync splits them back (vLLM loads checkpoint names)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.sync.gather import PolicyWeights
    from trainer.sync.weight_sync import checkpoint_manifest

    model_dir = build_tiny_model(tmp_path / "next", arch="qwen3_next")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in model.named_parameters())
    weights = PolicyWeights(model)
    saved = load_file(model_dir / "model.safetensors")
    check_against_manifest(weights.meta(), checkpoint_manifest(model_dir))
    sent = dict(weights)
    assert sent.keys() == saved.keys()
    assert all(torch.equal(sent[n], saved[n]) for n in saved)
