"""One rank of a sharded (FSDP2) training run, launched by ``tests/trainer/training/test_fsdp.py``::

    torchrun --nproc_per_node 2 tests/trainer/training/fsdp_run.py MODEL_DIR SERVER_URL OUT_DIR

Three runs in one launch, on CPU (gloo) against the given vLLM server, each rank writing what the
test compares into ``OUT_DIR``:

1. full training, 2 steps, a checkpoint at step 2: ``full<r>.pt`` (this rank's parameters, gathered
   from the shards), ``full<r>.json`` (steps, version, whether the parameters were DTensors), and on
   rank 0 ``sent.pt`` (the tensors of the last weight sync, as the sender received them);
2. resumed from that checkpoint for 1 more step: ``resumed<r>.pt`` (the parameters gathered when the
   resumed run's first step begins, before any update) and ``resumed<r>.json`` (the prompt position
   the rollout worker restarted at);
3. LoRA, 1 step, merged-weight sync: ``lora<r>.pt`` (base + adapter, gathered) and on rank 0
   ``lora_sent.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback

from tests.trainer.spread_reward import token_reward
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.sync.backends.shared_memory import SharedMemorySender
from trainer.sync.gather import full_tensor

SENT: dict[str, torch.Tensor] = {}


def _record_sent() -> None:
    """Rank 0: keep a copy of every tensor the shared-memory sender writes (the last sync wins)."""
    original = SharedMemorySender.transfer

    def transfer(self: SharedMemorySender, weights: Any, version: int, **kwargs: Any) -> None:
        SENT.clear()

        def tap() -> Any:
            for name, tensor in weights:
                SENT[name] = tensor.detach().clone()
                yield name, tensor

        original(self, tap(), version, **kwargs)

    SharedMemorySender.transfer = transfer  # type: ignore[method-assign]


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p).clone() for n, p in model.named_parameters()}


class _FirstStepParams(TrainerCallback):
    """The parameters (gathered) when the first step of the run begins."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if self.params is None:
            self.params = _gathered(model)


def _args(out: Path, name: str, **kw: Any) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(
        output_dir=str(out / name), vllm_server_base_url=sys.argv[2], num_generations=4, max_completion_length=8,
        learning_rate=1e-3, report_to="none", use_cpu=True, logging_steps=1, rollout_worker_timeout=120,
        vllm_server_timeout=120, disable_tqdm=True, gradient_checkpointing=False, fsdp="full_shard",
        fsdp_config={"version": 2}, **kw)


def main(model_dir: str, out_dir: str) -> None:
    """The three runs (see the module docstring)."""
    out = Path(out_dir)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(32)]})
    first = AsyncGRPOTrainer(model=model_dir, reward_funcs=token_reward, train_dataset=data,
                             args=_args(out, "full", max_steps=2, save_strategy="steps", save_steps=2))
    rank = first.accelerator.process_index
    if rank == 0:
        _record_sent()
    first.train()
    params = _gathered(first.model)
    sharded = any(type(p).__name__ == "DTensor" for p in first.model.parameters())
    torch.save(params, out / f"full{rank}.pt")
    (out / f"full{rank}.json").write_text(json.dumps({
        "global_step": first.state.global_step, "policy_version": first._policy_version, "dtensor": sharded,
        "fsdp": first.is_fsdp_enabled, "position": first._step_feed_state.first_untrained,
        "logs": [h for h in first.state.log_history if "loss" in h]}))
    if rank == 0:
        torch.save(SENT, out / "sent.pt")

    probe = _FirstStepParams()
    resumed = AsyncGRPOTrainer(model=model_dir, reward_funcs=token_reward, train_dataset=data, callbacks=[probe],
                               args=_args(out, "full", max_steps=3, save_strategy="no"))
    resumed.train(resume_from_checkpoint=True)
    torch.save(probe.params, out / f"resumed{rank}.pt")
    (out / f"resumed{rank}.json").write_text(json.dumps({
        "global_step": resumed.state.global_step, "resume_state": resumed._resume_state,
        "policy_version": resumed._policy_version}))

    from peft import LoraConfig

    lora = AsyncGRPOTrainer(model=model_dir, reward_funcs=token_reward, train_dataset=data,
                            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                            args=_args(out, "lora", max_steps=1, save_strategy="no"))
    lora.train()
    torch.save(_gathered(lora.model), out / f"lora{rank}.pt")
    if rank == 0:
        torch.save(SENT, out / "lora_sent.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3])
