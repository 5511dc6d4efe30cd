"""A tiny Gated DeltaNet hybrid (Qwen3-Next) trains end to end against a real vLLM CPU server, weight sync included.

vLLM's CPU build serves the hybrid in bfloat16 with chunked prefill on (the launcher's choice for hybrids);
the trainer keeps float32. Its Qwen3.5 model does not import on this machine (torchvision is absent), so
Qwen3.5 is tested up to the server: tests/trainer/training/test_gated_deltanet.py and test_model_loading.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.spread_reward import token_reward
from tests.trainer.test_async_trainer import _config, _dataset, _server_logprobs
from toolgym.kit.tiny_model import build_tiny_model
from trainer import AsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig, is_hybrid
from trainer.training.gated_deltanet import gated_deltanet_modules


@pytest.mark.vllm
def test_tiny_qwen3_next_trains_and_the_server_serves_the_update(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "qwen3_next", arch="qwen3_next")
    assert is_hybrid(str(model_dir))
    config = VLLMServerConfig(model=str(model_dir), max_model_len=256)
    assert "bfloat16" in config.command(8000) and "--enable-chunked-prefill" in config.command(8000)
    with VLLMServer(config).start() as server:
        prompt = [5, 17, 42, 7, 99]
        before = _server_logprobs(server.base_url, prompt)
        trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=token_reward,
                                   args=_config(tmp_path, server, max_steps=2), train_dataset=_dataset())
        assert len(gated_deltanet_modules(trainer.model)) == 3  # trained through the tree path
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        after = _server_logprobs(server.base_url, prompt)

    assert trainer.state.global_step == 2 and trainer.stream.policy_version == 2
    assert after != before, "the server must serve the trained weights"
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p.detach(), initial[n])]
    assert not unchanged, f"parameters that did not change: {unchanged}"
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert any(h.get("batch/packing_ratio", 1.0) > 1.0 for h in trainer.state.log_history)  # prompts shared
