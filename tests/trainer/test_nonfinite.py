"""Non-finite numbers never reach the weights or the vLLM server (real server, real worker).

A reward of ``inf`` once trained two steps "successfully" (loss 0.0, gradient norm NaN), left non-finite
weights and synced them to the server, which then failed the next run. Now a non-finite reward scores
like ``None`` (that rollout is scored by its other sources only), and a step whose gradients are not
finite is skipped: weights, optimizer state and the served weights stay as they were.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from tests.trainer.fault_tools import NaNAdvantageLoop, inf_for_the_first
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer
from trainer.sync.weight_sync import WeightSynchronizer
from trainer.vllm.client import SamplerClient, SamplingParams

pytestmark = pytest.mark.vllm


def _config(tmp_path: Path, server: VLLMServer, **overrides: Any) -> AsyncGRPOConfig:
    kwargs: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=server.base_url, max_steps=2, num_generations=4,
        max_completion_length=16, learning_rate=1e-3, report_to="none", use_cpu=True,
        gradient_checkpointing=False, save_strategy="no", logging_steps=1, rollout_worker_timeout=60,
        vllm_server_timeout=60, disable_tqdm=True)
    kwargs.update(overrides)
    return AsyncGRPOConfig(**kwargs)


def _dataset(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(n)]})


def _served_completion(server: VLLMServer) -> list[int]:
    async def go() -> list[int]:
        async with SamplerClient(server.base_url) as client:
            turn = await client.complete([1, 2, 3], SamplingParams(max_tokens=8, logprobs=1), seed=0)
        assert all(lp == lp and abs(lp) != float("inf") for lp in turn.output_log_probs)
        return turn.output_ids
    return asyncio.run(go())


class NaNAdvantageTrainer(AsyncGRPOTrainer):
    loop_cls = NaNAdvantageLoop


def test_an_inf_reward_scores_nothing_and_the_weights_stay_finite(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=inf_for_the_first, train_dataset=_dataset(8),
                               args=_config(tmp_path, vllm_server))
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(loss == loss and abs(loss) != float("inf") for loss in losses)
    assert _served_completion(vllm_server)  # the synced weights serve finite log-probs


def test_a_step_with_nan_gradients_is_skipped_never_applied_or_synced(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    served_before = _served_completion(vllm_server)
    trainer = NaNAdvantageTrainer(model=str(tiny_model_dir), reward_funcs=inf_for_the_first,
                                  train_dataset=_dataset(8), args=_config(tmp_path, vllm_server, max_steps=3))
    trainer.train()
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert all(torch.equal(p, q) for p, q in zip(original.parameters(), trainer.model.parameters(), strict=True))
    skipped = sum(h.get("batch/skipped_nonfinite_step_count", 0.0) for h in trainer.state.log_history)
    assert skipped == 3
    assert "the loss or a gradient is not finite" in caplog.text
    assert trainer._policy_version == 0  # nothing was synced
    assert _served_completion(vllm_server) == served_before
