"""Seam details: requests name the served base model, ``group_id`` counts groups from 0, and each training
sample carries the ``rollout_id`` of the rollout it came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset

from tests.trainer.rollout.test_scoring import _scoring_loop, make_group
from tests.trainer.spread_reward import token_reward
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer
from trainer.records import Rollout, TrainingSequence
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.sync.weight_sync import WeightSynchronizer
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.server_info import read_server_info, served_model_entry


def test_the_base_model_is_named_not_the_first_listed() -> None:
    models = {"data": [{"id": "adapter-v3", "parent": "org/base"}, {"id": "org/base", "parent": None}]}
    assert served_model_entry(models)["id"] == "org/base"
    assert served_model_entry(models, configured=["adapter-v3"])["id"] == "adapter-v3"  # the server's own name


@pytest.mark.vllm
def test_the_served_name_is_read_from_the_server(vllm_server: VLLMServer, tiny_model_dir: Path) -> None:
    info = read_server_info(VLLMAdminClient(vllm_server.base_url, timeout_s=60))
    assert info.model == str(tiny_model_dir) and info.max_model_len == 1024


def test_samples_carry_their_rollout_id_and_group_id(tmp_path: Path) -> None:
    loop = _scoring_loop(tmp_path, mask=False)
    group = make_group(3)
    group.group_id = 5
    group.rollout_rewards = [1.0, 0.0, 0.5]
    group.completions_sequences = [[TrainingSequence(input_ids=[1, 10 + i], loss_mask=[0, 1],
                                                     sampler_logprobs=[0.0, -0.5])] for i in range(3)]
    try:
        queued = loop.scheduler.score(group, [], position=40, rollout_ids=["r0", "r1", "r2"])
    finally:
        loop.executor.shutdown()
    assert [(s.rollout_id, s.group_id) for s in queued.samples] == [("r0", 5), ("r1", 5), ("r2", 5)]
    assert queued.position == 40  # the stream position stays the epoch bookkeeping's


class GroupRecordingLoop(AsyncRolloutLoop):
    """Appends the ``group_id`` of every rollout to ``<record_dir>/groups.txt``."""

    def __init__(self, *args: Any, record_dir: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record_dir = Path(record_dir)

    async def generate_one(self, prompt: list[dict[str, Any]], tools: list[Any], group_id: int = 0) -> Rollout:
        """The default rollout, recorded."""
        with open(self.record_dir / "groups.txt", "a") as f:
            f.write(f"{group_id}\n")
        return await super().generate_one(prompt, tools, group_id=group_id)


class GroupRecordingTrainer(AsyncGRPOTrainer):
    """Runs :class:`GroupRecordingLoop`, recording into the run's ``output_dir``."""

    loop_cls = GroupRecordingLoop

    def rollout_loop_kwargs(self) -> dict[str, Any]:
        """The folder the loop records into."""
        return {"record_dir": self.args.output_dir}


@pytest.mark.vllm
def test_group_ids_count_groups_from_zero(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path,
                                          restore_served_weights: WeightSynchronizer) -> None:
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), vllm_server_base_url=vllm_server.base_url, max_steps=2, num_generations=2,
        max_completion_length=8, report_to="none", use_cpu=True, gradient_checkpointing=False, save_strategy="no",
        rollout_worker_timeout=60, vllm_server_timeout=60, disable_tqdm=True)
    prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(6)]
    GroupRecordingTrainer(model=str(tiny_model_dir), reward_funcs=token_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts})).train()
    ids = sorted(int(line) for line in (tmp_path / "groups.txt").read_text().split())
    groups = sorted(set(ids))
    # Ids are handed out as groups start; two steps trained at least two groups, both of whose rollouts ran.
    assert groups[:2] == [0, 1] and ids.count(0) == 2 and all(ids.count(g) <= 2 for g in groups)
