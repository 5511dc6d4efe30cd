"""A training run for the SIGKILL test (``python -m tests.trainer.fault_run``): a checkpoint every
step, and one JSON line per event in ``--record`` (``worker`` with the rollout worker's pid; per step
``begin``, and ``end`` with the dataset rows whose samples the step trained), written through to
disk so a SIGKILL loses none."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from datasets import Dataset
from transformers import TrainerCallback

from tests.trainer.fault_tools import rank_reward
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer


class RecordSteps(TrainerCallback):
    """Appends ``{"event": "worker"|"begin"|"end", ...}`` lines, fsynced."""

    def __init__(self, trainer: AsyncGRPOTrainer, path: str) -> None:
        self.trainer, self.path = trainer, path

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.trainer.stream is not None and self.trainer.worker is not None
        self.trainer.stream.keep_samples = True  # take_trained_samples() returns each step's samples
        self._write({"event": "worker", "pid": self.trainer.worker.process.pid})

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._write({"event": "begin", "step": state.global_step + 1})

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rows = sorted({s.row_index for s in self.trainer.stream.take_trained_samples()})
        self._write({"event": "end", "step": state.global_step, "rows": rows})


def main() -> None:
    """Train (or resume) the tiny model for ``--max-steps`` steps."""
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--vllm-url", "--output-dir", "--record"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    config = AsyncGRPOConfig(
        output_dir=args.output_dir, vllm_server_base_url=args.vllm_url, max_steps=args.max_steps,
        num_generations=4, max_completion_length=16, learning_rate=1e-3, report_to="none", use_cpu=True,
        gradient_checkpointing=False, save_strategy="steps", save_steps=1, logging_steps=1,
        max_staleness=8, rollout_worker_timeout=60, vllm_server_timeout=60, disable_tqdm=True)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(200)]})
    trainer = AsyncGRPOTrainer(model=args.model, reward_funcs=rank_reward, train_dataset=dataset, args=config)
    trainer.add_callback(RecordSteps(trainer, args.record))
    trainer.train(resume_from_checkpoint=True if args.resume else None)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)  # beside the vLLM CPU server (see tests/conftest.py)
    main()
