"""A training run reads what the vLLM server is once: one GET each of ``/v1/models``, ``/server_info`` and
``/metrics`` at start (real server behind a counting proxy, real trainer and rollout worker)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset
from peft import LoraConfig

from tests.trainer.spread_reward import token_reward
from tests.trainer.vllm.counting_proxy import counting_proxy
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer
from trainer.sync.weight_sync import WeightSynchronizer

WORKER_STARTS = ("GET", "/health")
"""The rollout worker's first request (it waits for the server): every request before it is the start's."""


@pytest.mark.parametrize("peft_config", [None, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])],
                         ids=["full", "lora"])
def test_a_run_reads_the_server_once_at_start(
    peft_config: Any, vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path,
    restore_served_weights: WeightSynchronizer,
) -> None:
    # Before: /v1/models twice and /server_info once at start (twice with a LoRA model, whose sync
    # asked /server_info again whether the server loads adapters).
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(4)]})
    with counting_proxy(vllm_server.base_url) as proxy:
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"), vllm_server_base_url=proxy.base_url, max_steps=1, num_generations=4,
            max_completion_length=8, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
            rollout_worker_timeout=60, vllm_server_timeout=60)
        trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=token_reward, args=args,
                                   train_dataset=data, peft_config=peft_config)
        trainer.train()
    assert trainer.state.global_step == 1
    assert WORKER_STARTS in proxy.requests and ("POST", "/v1/completions") in proxy.requests
    at_start = {path: proxy.count("GET", path, before=WORKER_STARTS) for path in ("/v1/models", "/server_info",
                                                                                 "/metrics")}
    assert at_start == {"/v1/models": 1, "/server_info": 1, "/metrics": 1}, proxy.requests
    # Nothing reads them again later either (the worker's /metrics polls are its load watch).
    assert proxy.count("GET", "/v1/models") == 1 and proxy.count("GET", "/server_info") == 1, proxy.requests
