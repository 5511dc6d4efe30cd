"""One rank under ``accelerate launch`` with an FSDP2 config file, launched by ``tests/trainer/training/test_fsdp.py``::

    accelerate launch --config_file fsdp.yaml tests/trainer/training/accelerate_fsdp_probe.py MODEL_DIR OUT_DIR

Builds the trainer from the config file alone (no ``fsdp`` field), prepares the model as training
does, and writes ``rank<r>.json``: whether FSDP is on and whether every parameter is a DTensor shard.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from datasets import Dataset

from trainer import AsyncGRPOConfig, AsyncGRPOTrainer


def zero_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Unused: nothing is trained."""
    return [0.0] * len(completions)


def main(model_dir: str, out_dir: str) -> None:
    """Build, prepare, report (see the module docstring)."""
    out = Path(out_dir)
    args = AsyncGRPOConfig(output_dir=str(out / "run"), use_cpu=True, report_to="none", disable_tqdm=True,
                           save_strategy="no", gradient_checkpointing=False)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=zero_reward, args=args, train_dataset=data)
    model = trainer.accelerator.prepare(trainer.model)
    (out / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps({
        "fsdp": trainer.is_fsdp_enabled,
        "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
