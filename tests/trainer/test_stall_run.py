"""No silent stall on the real stack: a run that can train nothing says why within seconds of the first
warning bound and stops at ``stall_timeout`` with PipelineStalledError and a checkpoint (real vLLM CPU
server, real rollout worker)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import PipelineStalledError
from trainer.launch.vllm_server import VLLMServer

pytestmark = pytest.mark.vllm


def constant_or_nothing(completion_ids: list[list[int]], kind: list[str], **kwargs: Any) -> list[float | None]:
    """The same reward for every rollout (no spread), or ``None`` / ``nan`` (unscorable), by the row's kind."""
    value = {"constant": 1.0, "none": None, "nan": float("nan")}[kind[0]]
    return [value] * len(completion_ids)


def test_a_run_that_can_train_nothing_says_why_and_stops(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=vllm_server.base_url, max_steps=5,
        num_generations=4, max_completion_length=8, report_to="none", use_cpu=True, gradient_checkpointing=False,
        save_strategy="no", rollout_worker_timeout=60, vllm_server_timeout=60, disable_tqdm=True, stall_timeout=36)
    kinds = ["constant", "none", "nan"] * 40
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {i}."}] for i in range(len(kinds))],
                                 "kind": kinds})
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=constant_or_nothing, train_dataset=dataset,
                               args=args)
    with pytest.raises(PipelineStalledError, match=r"no trainable sample for 3\d s of waiting") as stalled:
        trainer.train()
    message = str(stalled.value)
    assert re.search(r"[1-9]\d* for zero reward spread", message) and re.search(r"[1-9]\d* unscorable", message)
    warnings = [r.getMessage() for r in caplog.records if "no trainable sample for" in r.getMessage()]
    assert len(warnings) >= 5, "warned every 5 s before stopping, with the counts"
    stalls = [h for h in trainer.state.log_history if "pipeline/stalled_s" in h]
    assert stalls and stalls[0]["pipeline/stalled_s"] < 12, "the first report comes within seconds of its bound"
    assert (tmp_path / "out" / "checkpoint-0" / "rollout_state.json").exists(), "a checkpoint, save_strategy='no'"
