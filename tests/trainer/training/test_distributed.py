"""Multi-process training: rank 0 feeds the other ranks (``trainer/training/distributed.py``).

Real ``torch.distributed`` on CPU (gloo), real processes: the feed and its failure paths between
spawned ranks, the gradient of two ranks against one process, and a 2-rank ``torchrun`` run against
the real vLLM CPU server and a real rollout worker.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as tmp
from datasets import Dataset

from tests.trainer.training.torchrun import torchrun_two_ranks
from trainer.exceptions import RolloutWorkerError
from trainer.launch.vllm_server import VLLMServer, free_port
from trainer.records import TrainingSample, TrainingSequence
from trainer.training.batching import MicroBatch
from trainer.training.packing import build_row

pytestmark = pytest.mark.slow  # every test starts two or more processes (10-40 s each)


def _sample(ids: list[int], trained_from: int, advantage: float, group: int) -> TrainingSample:
    n = len(ids)
    mask = [0] * trained_from + [1] * (n - trained_from)
    logq = [0.0] * trained_from + [-7.6 - 0.05 * i for i in range(n - trained_from)]  # near the tiny model's own
    return TrainingSample(TrainingSequence(ids, mask, logq), advantage=advantage, group_id=group, policy_version=0)


def _micro_batch() -> MicroBatch:
    """Two rows of different samples (row A for rank 0, row B for rank 1)."""
    row_a = build_row([_sample([5, 6, 7, 8, 9, 10], 3, 1.0, 0), _sample([5, 6, 7, 11, 12], 3, -1.0, 0)])
    row_b = build_row([_sample([20, 21, 22, 23, 24, 25, 26], 2, 0.5, 1)])
    rows = [row_a, row_b]
    return MicroBatch(rows=rows, num_trained_global=sum(r.num_trained for r in rows), num_samples=3,
                      forwarded_tokens=sum(r.num_unique_tokens for r in rows),
                      unpacked_tokens=sum(r.num_unpacked_tokens for r in rows))


def _spawn(target: Any, world: int, *args: Any) -> list[dict[str, Any]]:
    """Run ``target(rank, world, port, queue, *args)`` in ``world`` spawned processes; their reports."""
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(target, rank, world, port, queue, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    reports = []
    try:
        for _ in range(world):
            reports.append(queue.get(timeout=240))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    return sorted(reports, key=lambda r: r["rank"])


def _entry(target: Any, rank: int, world: int, port: int, queue: Any, *args: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    report: dict[str, Any] = {"rank": rank}
    try:
        report.update(target(rank, world, *args) or {})
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["error_type"] = type(exc).__name__
        report["traceback"] = traceback.format_exc()
    queue.put(report)
    if report.get("exit_now"):
        queue.close()
        queue.join_thread()  # flush the report, then vanish without any cleanup
        os._exit(0)


# ------------------------------------------------------------------------------ the feed
def _feed_roundtrip(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from trainer.training.distributed import StepFeed, StepPayload

    dist.init_process_group("gloo", rank=rank, world_size=world)
    feed = StepFeed(timeout_s=30)
    sent = _micro_batch()
    try:
        if rank == 0:
            for step in range(2):
                feed.send(StepPayload([sent, sent], epoch_done=step == 1, first_untrained=step, policy_version=step))
            return {}
        got = [next(feed) for _ in range(4)]
        return {"equal": all(torch.equal(b.rows[1].input_ids, sent.rows[1].input_ids) for b in got),
                "trained": [b.num_trained_global for b in got], "last": [feed.last.epoch_done,
                                                                          feed.last.policy_version]}
    finally:
        feed.close()
        dist.destroy_process_group()


def test_feed_carries_each_steps_micro_batches() -> None:
    reports = _spawn(_feed_roundtrip, 2)
    assert not any("error" in r for r in reports), reports
    peer = reports[1]
    assert peer["equal"] and peer["trained"] == [_micro_batch().num_trained_global] * 4
    assert peer["last"] == [True, 1]


def _rank0_fails(rank: int, world: int, how: str) -> dict[str, Any]:
    import torch.distributed as dist

    from trainer.training.distributed import StepFeed

    dist.init_process_group("gloo", rank=rank, world_size=world)
    feed = StepFeed(timeout_s=3, heartbeat_s=0.2)
    if rank == 0:
        if how == "raises":
            feed.fail(RolloutWorkerError("the rollout worker failed: reward exploded"))
            time.sleep(5)  # stay alive: the peer must learn the error from the store, not a dead socket
            return {}
        if how == "hangs":
            feed.close()  # the heartbeat stops, the process stays
            time.sleep(8)
            return {}
        return {"exit_now": True}  # killed: no goodbye, the process is gone
    t0 = time.monotonic()
    try:
        next(feed)
    finally:
        feed.close()
    return {"waited_s": time.monotonic() - t0}


@pytest.mark.parametrize("how, error_type, message", [
    ("raises", "RolloutWorkerError", "reward exploded"),
    ("hangs", "RankZeroLostError", "no heartbeat"),
    ("dies", "RankZeroLostError", "lost rank 0|no heartbeat"),
])
def test_peer_stops_when_rank0_fails(how: str, error_type: str, message: str) -> None:
    import re

    reports = _spawn(_rank0_fails, 2, how)
    peer = reports[1]
    assert peer.get("error_type") == error_type, peer
    assert re.search(message, peer["error"]), peer["error"]


# ------------------------------------------------------------------------------ gradients
def _ddp_grads(rank: int, world: int, model_dir: str, out: str) -> dict[str, Any]:
    from trainer import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=out, use_cpu=True, report_to="none", gradient_checkpointing=False,
                           disable_tqdm=True, save_strategy="no")
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    trainer = AsyncGRPOTrainer(model=model_dir, args=args, train_dataset=data, reward_funcs=lambda_free_reward)
    assert trainer.accelerator.num_processes == world
    model = trainer.accelerator.prepare(trainer.model)
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.training_step(model, _micro_batch())
    if rank == 0:
        torch.save({n: p.grad.clone() for n, p in trainer.model.named_parameters()}, Path(out) / "ddp_grads.pt")
    return {"loss": float(loss), "type": type(model).__name__}


def lambda_free_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Unused: the test calls training_step directly."""
    return [0.0] * len(completions)


def test_two_ranks_give_the_single_process_gradient(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.training.logprobs import forward_packed
    from trainer.training.loss import LossConfig, grpo_loss
    from trainer.training.tree_attention import enable_tree_attention

    reports = _spawn(_ddp_grads, 2, str(tiny_model_dir), str(tmp_path))
    assert not any("error" in r for r in reports), [r.get("traceback") for r in reports]
    assert reports[0]["type"] == "DistributedDataParallel"
    ddp_grads = torch.load(tmp_path / "ddp_grads.pt")

    # One process, rows A then B accumulated, each normalised by the global trained-token count.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    enable_tree_attention(model)
    mb = _micro_batch()
    losses = []
    for row in mb.rows:
        loss, _ = grpo_loss(forward_packed(model, row, 1.0), row, LossConfig(), mb.num_trained_global)
        loss.backward()
        losses.append(float(loss.detach()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(ddp_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # The logged loss (mean over ranks of each rank's scaled loss) is the global loss.
    assert sum(r["loss"] for r in reports) / 2 == pytest.approx(sum(losses), rel=1e-5)


# ------------------------------------------------------------------------------ a real run
@pytest.mark.timeout(1500)  # a vLLM start, two trainers and a rollout worker on a shared 2-core machine
def test_torchrun_two_ranks_train_together(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path,
                                           restore_served_weights: Any) -> None:
    returncode, stderr = torchrun_two_ranks("distributed_run.py", str(tiny_model_dir), vllm_server.base_url,
                                            str(tmp_path))
    assert returncode == 0, stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    params = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    for rec in ranks:
        assert rec["global_step"] == 2 and rec["policy_version"] == 2
        assert len(rec["rows"]) == 4  # 2 steps x gradient_accumulation_steps=2
        assert all(row["trained"] > 0 for row in rec["rows"]), "every rank gets a non-empty row"
    # Same micro-batches, different rows: the global counts agree, the rows differ.
    assert [r["global_trained"] for r in ranks[0]["rows"]] == [r["global_trained"] for r in ranks[1]["rows"]]
    assert all(a["tokens"] != b["tokens"] for a, b in zip(ranks[0]["rows"], ranks[1]["rows"], strict=True))
    for a, b in zip(ranks[0]["rows"], ranks[1]["rows"], strict=True):
        assert a["trained"] + b["trained"] == a["global_trained"]
    # DDP kept the replicas identical, and training moved them.
    from transformers import AutoModelForCausalLM

    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    for name, p in params[0].items():
        assert torch.equal(p, params[1][name]), name
    assert any(not torch.equal(p, initial[name].detach()) for name, p in params[0].items())
    assert len(ranks[0]["logged_loss"]) == 2
    # Only rank 0 ran a rollout worker, and it is gone.
    assert ranks[1]["worker_pid"] is None and ranks[0]["worker_pid"] is not None
    with pytest.raises(ProcessLookupError):
        os.kill(ranks[0]["worker_pid"], 0)


def _train_without_server(rank: int, world: int, model_dir: str, out: str, url: str) -> dict[str, Any]:
    from trainer import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=out, use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no",
                           max_steps=2, vllm_server_base_url=url, vllm_server_timeout=2, rollout_worker_timeout=60)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    AsyncGRPOTrainer(model=model_dir, args=args, train_dataset=data, reward_funcs=lambda_free_reward).train()
    return {}


def test_failure_at_start_reaches_every_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    reports = _spawn(_train_without_server, 2, str(tiny_model_dir), str(tmp_path), url)
    for report in reports:
        assert report.get("error_type") == "VLLMServerError", report
        assert "could not reach the vLLM server" in report["error"]
    assert "raised on rank 0" in reports[1]["traceback"]
