"""LoRA, merged-weight sync (the default): the server serves base + adapter merged, under the
checkpoint's names, and the trainer's model keeps its adapter separate (real vLLM CPU server)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer
from trainer.sync.weight_sync import WeightSynchronizer
from trainer.vllm.client import SamplerClient, SamplingParams

PROMPT = [5, 17, 42, 99, 7]


def zero_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Unused: nothing is trained here."""
    return [0.0] * len(completions)


def _sample(base_url: str, model: str | None = None) -> tuple[list[int], list[float]]:
    """12 tokens sampled after ``PROMPT`` (seed 5) from ``model`` (default: the served model)."""
    async def go() -> tuple[list[int], list[float]]:
        async with SamplerClient(base_url) as client:
            params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=1)
            turn = await client.complete(PROMPT, params, seed=5, model=model)
            return turn.output_ids, turn.output_log_probs

    return asyncio.run(go())


def _logprobs(model: torch.nn.Module, output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + output])).logits[0].float(), dim=-1)
    positions = torch.arange(len(PROMPT) - 1, len(PROMPT) - 1 + len(output))
    return logp[positions, torch.tensor(output)]


def test_merged_lora_weights_reach_the_server(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer
) -> None:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                           disable_tqdm=True, vllm_server_base_url=vllm_server.base_url)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=zero_reward, peft_config=lora, args=args,
                               train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]}))
    torch.manual_seed(0)
    with torch.no_grad():  # lora_B starts at zero: give the adapter an effect
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}

    restore_served_weights.sync(trainer._policy_sync.policy_weights(), version=3)  # checks names and shapes first

    # The trainer's model is unmerged again: base weights as before, adapter still separate.
    for n, p in trainer.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p.detach(), base_before[n]), n
    # The server's log-probs are those of the merged model, and differ from the base model's.
    merged = trainer.model.merge_and_unload()
    output, served = _sample(vllm_server.base_url)
    torch.testing.assert_close(torch.tensor(served), _logprobs(merged, output), atol=1e-4, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert (torch.tensor(served) - _logprobs(base, output)).abs().max() > 1e-2
