"""One rank of a multi-process training run, launched by ``tests/trainer/training/test_distributed.py``::

    torchrun --nproc_per_node 2 tests/trainer/training/distributed_run.py MODEL_DIR SERVER_URL OUT_DIR

Each rank trains 2 steps on CPU (gloo) against the given vLLM server, then writes
``OUT_DIR/rank<r>.json`` (the rows it forwarded, the policy version, the rollout worker's pid) and
``OUT_DIR/rank<r>.pt`` (its final parameters), which the test compares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from tests.trainer.spread_reward import token_reward
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.training.batching import MicroBatch


class RecordingTrainer(AsyncGRPOTrainer):
    """Records, per micro-batch, what this rank forwarded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows_seen: list[dict[str, Any]] = []

    def training_step(self, model: torch.nn.Module, inputs: MicroBatch, num_items_in_batch: Any = None) -> torch.Tensor:
        row = inputs.row_for(self.accelerator.process_index)
        self.rows_seen.append({"step": self.state.global_step, "trained": row.num_trained,
                               "global_trained": inputs.num_trained_global,
                               "tokens": row.input_ids.tolist()})
        return super().training_step(model, inputs, num_items_in_batch)


def main(model_dir: str, server_url: str, out_dir: str) -> None:
    """Train 2 steps and write this rank's record."""
    out = Path(out_dir)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(16)]})
    args = AsyncGRPOConfig(
        output_dir=str(out / "run"), vllm_server_base_url=server_url, max_steps=2, num_generations=4,
        max_completion_length=16, learning_rate=1e-3, report_to="none", use_cpu=True, save_strategy="no",
        logging_steps=1, rollout_worker_timeout=120, vllm_server_timeout=120, disable_tqdm=True,
        gradient_accumulation_steps=2,
    )
    trainer = RecordingTrainer(model=model_dir, reward_funcs=token_reward, args=args, train_dataset=dataset)
    worker_pid = None
    original_shutdown = trainer._shutdown

    def record_pid_then_shutdown() -> None:
        nonlocal worker_pid
        if trainer.worker is not None:
            worker_pid = trainer.worker.process.pid
        original_shutdown()

    trainer._shutdown = record_pid_then_shutdown  # type: ignore[method-assign]
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save({n: p.detach().cpu() for n, p in trainer.model.named_parameters()}, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rows": trainer.rows_seen, "policy_version": trainer._policy_version,
        "global_step": trainer.state.global_step, "worker_pid": worker_pid,
        "logged_loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
