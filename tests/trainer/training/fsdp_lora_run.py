"""One rank of a sharded (FSDP2) LoRA run with adapter-only sync, launched by
``tests/trainer/sync/test_lora_adapter_sync.py``::

    torchrun --nproc_per_node 2 tests/trainer/training/fsdp_lora_run.py MODEL_DIR LORA_SERVER_URL OUT_DIR

2 steps on CPU (gloo) against a server started with ``--enable-lora``. Every rank writes
``lora<r>.pt`` (its adapter tensors gathered from the shards after the run) and ``lora<r>.json``
(steps, version, whether the parameters were sharded); rank 0 also keeps a copy of each adapter
version it wrote for the server (``adapter_v<version>.safetensors``: the folder is removed when
the version is retired) and ``loads.json`` (the versions it loaded, in order).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig

from tests.trainer.spread_reward import token_reward
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.sync.gather import full_tensor
from trainer.sync.lora_sync import LoRAAdapterSync

LOADED: list[int] = []


def _keep_adapters(out: Path) -> None:
    """Rank 0: copy every adapter version as written, before the sync retires its folder."""
    original = LoRAAdapterSync.register

    def register(self: LoRAAdapterSync, i: int, version: int) -> None:
        original(self, i, version)
        shutil.copy(self.folder(version) / "adapter_model.safetensors", out / f"adapter_v{version}.safetensors")
        LOADED.append(version)

    LoRAAdapterSync.register = register  # type: ignore[method-assign]


def main(model_dir: str, server_url: str, out_dir: str) -> None:
    """The run (see the module docstring)."""
    out = Path(out_dir)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(32)]})
    args = AsyncGRPOConfig(
        output_dir=str(out / "run"), vllm_server_base_url=server_url, num_generations=4, max_completion_length=8,
        learning_rate=1e-3, report_to="none", use_cpu=True, logging_steps=1, rollout_worker_timeout=120,
        vllm_server_timeout=120, disable_tqdm=True, gradient_checkpointing=False, fsdp="full_shard",
        fsdp_config={"version": 2}, max_steps=2, max_staleness=1, save_strategy="no")
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=token_reward, train_dataset=data, args=args,
                               peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    rank = trainer.accelerator.process_index
    if rank == 0:
        _keep_adapters(out)
    trainer.train()
    adapter = {n: full_tensor(p).clone() for n, p in trainer.model.named_parameters() if "lora_" in n}  # collectives
    torch.save(adapter, out / f"lora{rank}.pt")
    (out / f"lora{rank}.json").write_text(json.dumps({
        "global_step": trainer.state.global_step, "policy_version": trainer._policy_version,
        "dtensor": any(type(p).__name__ == "DTensor" for p in trainer.model.parameters())}))
    if rank == 0:
        (out / "loads.json").write_text(json.dumps(LOADED))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
