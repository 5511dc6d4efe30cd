"""Trainer faults on the real stack, each with a clear outcome within seconds, never a hang.

The real vLLM CPU server, real env server subprocesses (``toolgym serve``) that die by SIGKILL, a
real trainer subprocess killed by SIGKILL mid-step, a real full filesystem (a tmpfs the test mounts,
as root). The only injected thing is the cue: the served environment kills its own server at its
N-th ``get_reward`` (``tests/trainer/fault_tools.py``), so the server dies mid-episode every time.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from sdk import remote_factory
from tests.trainer.fault_tools import (
    REPO,
    always_hangs,
    dying_counter_server,
    exploding_reward,
    hang_on_row_one,
    rank_reward,
)
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.checkpoint import STAGING_DIR
from trainer.exceptions import CheckpointSaveError, RolloutWorkerError
from trainer.launch.envserver import EnvServerProcess
from trainer.launch.vllm_server import VLLMServer
from trainer.sync.weight_sync import WeightSynchronizer

pytestmark = pytest.mark.vllm


def _config(tmp_path: Path, server: VLLMServer, **overrides: Any) -> AsyncGRPOConfig:
    kwargs: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=server.base_url, max_steps=3, num_generations=4,
        max_completion_length=16, learning_rate=1e-3, report_to="none", use_cpu=True,
        gradient_checkpointing=False, save_strategy="no", logging_steps=1, rollout_worker_timeout=60,
        vllm_server_timeout=60, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return AsyncGRPOConfig(**kwargs)


def _dataset(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(n)],
                              "row_id": list(range(n))})


def _total(trainer: AsyncGRPOTrainer, name: str) -> float:
    return sum(h.get(name, 0.0) for h in trainer.state.log_history)


class _Watch:
    """Notes when an env server process exits (and restarts it when asked)."""

    def __init__(self, server: EnvServerProcess, restart: bool) -> None:
        self.server, self.restart = server, restart
        self.died_at: float | None = None
        self.restarted_at: float | None = None
        self.exit_code: int | None = None
        self.successor: EnvServerProcess | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.server.process is not None
        self.exit_code = self.server.process.wait()
        self.died_at = time.monotonic()
        if self.restart:  # the same port, no kill cue: a fresh process without the old sessions
            self.successor = dying_counter_server(self.server.port).start()
            self.restarted_at = time.monotonic()

    def stop(self) -> None:
        """Stop the restarted server too."""
        self._thread.join(60)
        if self.successor is not None:
            self.successor.stop()


class _StopAfter(TrainerCallback):
    """Stops training ``steps`` optimizer steps after ``event()`` first holds (checked at each step end)."""

    def __init__(self, event: Any, steps: int) -> None:
        self.event, self.steps = event, steps
        self.seen_at_step: int | None = None
        self.step_ends: list[float] = []  # monotonic time of each step end

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step_ends.append(time.monotonic())
        if self.seen_at_step is None and self.event():
            self.seen_at_step = state.global_step
        if self.seen_at_step is not None and state.global_step >= self.seen_at_step + self.steps:
            control.should_training_stop = True


# ------------------------------------------------------------------------ env server killed mid-episode


def _env_trainer(tmp_path: Path, vllm_server: VLLMServer, model: Path, urls: list[str], connect_timeout: float,
                 callbacks: list[TrainerCallback]) -> AsyncGRPOTrainer:
    factory = remote_factory(urls, "counter", connect_timeout=connect_timeout)
    return AsyncGRPOTrainer(model=str(model), reward_funcs=rank_reward, environment_factory=factory,
                            args=_config(tmp_path, vllm_server, max_steps=20), callbacks=callbacks)


def test_env_server_killed_mid_episode_fails_over_to_the_replica(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer
) -> None:
    with dying_counter_server(kill_at=3) as a, dying_counter_server() as b:
        watch = _Watch(a, restart=False)
        # The retry is counted once the lost session's resume attempt gives up (connect_timeout,
        # 5 s), and logged with the worker's next records: wait for that log, not for the death.
        stop = _StopAfter(lambda: _total(trainer, "rollout/env_retry_count") >= 1, steps=2)
        trainer = _env_trainer(tmp_path, vllm_server, tiny_model_dir, [a.url, b.url], 5.0, [stop])
        trainer.train()
    assert watch.exit_code == -signal.SIGKILL, "replica A died mid-episode (in its third get_reward)"
    assert stop.seen_at_step is not None, "the rollout caught on A started over on B (within 20 steps)"
    assert trainer.state.global_step == stop.seen_at_step + 2, "training went on after the retry"
    assert _total(trainer, "rollout/failed_count") == 0, "no rollout was lost"
    after = [t for t in stop.step_ends if t > watch.died_at]  # type: ignore[operator]
    print(f"replica A SIGKILLed mid-get_reward; {_total(trainer, 'rollout/env_retry_count'):g} rollouts restarted "
          f"on B, 0 lost; the next step ended {after[0] - watch.died_at:.1f} s after the kill; "
          f"{trainer.state.global_step} steps")


def test_env_server_killed_and_restarted_without_replica_resumes_the_run(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer
) -> None:
    with dying_counter_server(kill_at=3) as a:
        watch = _Watch(a, restart=True)
        stop = _StopAfter(lambda: watch.restarted_at is not None and _total(trainer, "rollout/env_retry_count") >= 1,
                          steps=2)
        # connect_timeout covers the restart: the session cannot resume (the new process never had
        # it), so the rollout starts over on a new session of the restarted server.
        trainer = _env_trainer(tmp_path, vllm_server, tiny_model_dir, [a.url], 60.0, [stop])
        try:
            trainer.train()
        finally:
            watch.stop()
    assert watch.exit_code == -signal.SIGKILL and watch.restarted_at is not None
    assert trainer.state.global_step == stop.seen_at_step + 2  # type: ignore[operator]
    assert _total(trainer, "rollout/env_retry_count") >= 1
    assert _total(trainer, "rollout/failed_count") == 0
    after = [t for t in stop.step_ends if t > watch.restarted_at]  # type: ignore[operator]
    print(f"the only server SIGKILLed mid-get_reward, back {watch.restarted_at - watch.died_at:.1f} s later; "  # type: ignore[operator]
          f"{_total(trainer, 'rollout/env_retry_count'):g} rollouts restarted, 0 lost; the next step ended "
          f"{after[0] - watch.died_at:.1f} s after the kill")  # type: ignore[operator]


def test_env_server_killed_without_replica_stops_the_run_naming_it(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer
) -> None:
    with dying_counter_server(kill_at=3) as a:
        watch = _Watch(a, restart=False)
        trainer = _env_trainer(tmp_path, vllm_server, tiny_model_dir, [a.url], 3.0, [])
        with pytest.raises(RolloutWorkerError, match=rf"could not reach env server {a.url} within 3 s") as info:
            trainer.train()
        stopped_at = time.monotonic()
    assert "ServerUnavailableError" in str(info.value)
    assert watch.died_at is not None
    # A resume attempt (3 s), then a new session's attempt (3 s), then the worker's traceback.
    assert stopped_at - watch.died_at < 30, f"stopped {stopped_at - watch.died_at:.1f} s after the server died"
    print(f"the only server SIGKILLed, not restarted: the run stopped {stopped_at - watch.died_at:.1f} s later "
          f"with: {str(info.value).strip().splitlines()[-1]}")
    assert trainer.worker is None


# --------------------------------------------------------------------------------- reward functions


def test_a_reward_that_hangs_on_one_prompt_is_timed_out_and_the_run_goes_on(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer
) -> None:
    timed_out: list[float] = []

    class StopOnceTimedOut(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            timed_out.append((logs or {}).get("rewards/hang_on_row_one/timeout_count", 0.0))
            if sum(timed_out) > 0 and state.global_step >= 2:
                control.should_training_stop = True

    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=hang_on_row_one, train_dataset=_dataset(4),
                               args=_config(tmp_path, vllm_server, max_steps=30, reward_timeout=2.0),
                               callbacks=[StopOnceTimedOut()])
    trainer.train()
    assert sum(timed_out) >= 1, "row 1's group timed out"
    assert trainer.state.global_step < 30, "the run stopped on the event, not on the step cap"
    print(f"reward hanging on row 1, reward_timeout=2 s: {sum(timed_out):g} groups timed out, the run trained "
          f"{trainer.state.global_step} steps")


def test_a_reward_that_always_hangs_stops_the_run_within_seconds(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=always_hangs, train_dataset=_dataset(12),
                               args=_config(tmp_path, vllm_server, reward_timeout=1.0))
    t0 = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=r"RewardTimeoutError: reward function 'always_hangs' ran past "
                                                 r"reward_timeout=1 s in 3 groups in a row"):
        trainer.train()
    assert time.monotonic() - t0 < 120
    print(f"reward hanging on every group, reward_timeout=1 s: train() raised after {time.monotonic() - t0:.1f} s "
          "(trainer start included)")
    assert trainer.worker is None


def test_a_reward_that_raises_stops_the_run_naming_it(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=exploding_reward, train_dataset=_dataset(12),
                               args=_config(tmp_path, vllm_server))
    t0 = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=r"RewardFunctionError: reward function 'exploding_reward' raised "
                                                 r"ZeroDivisionError: the grader divided by zero on purpose"):
        trainer.train()
    print(f"raising reward: train() raised after {time.monotonic() - t0:.1f} s (trainer start included)")
    assert trainer.worker is None


# ----------------------------------------------------------------------- the trainer killed mid-step


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an orphan's exit may wait to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _run_script(out: Path, record: Path, server: VLLMServer, model: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.trainer.fault_run", "--model", str(model), "--vllm-url", server.base_url,
         "--output-dir", str(out), "--record", str(record), "--max-steps", "6", *extra],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(out.parent / "stderr.txt", "ab"))


def test_trainer_killed_mid_step_resumes_from_its_checkpoint_without_losing_or_repeating_a_prompt(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer
) -> None:
    out, first, second = tmp_path / "out", tmp_path / "run1.jsonl", tmp_path / "run2.jsonl"
    proc = _run_script(out, first, vllm_server, tiny_model_dir)
    try:
        deadline = time.monotonic() + 400
        while not any(r["event"] == "begin" and r["step"] == 4 for r in _records(first)):
            assert proc.poll() is None, f"the first run exited early: {(tmp_path / 'stderr.txt').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the first run never reached step 4"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # step 4 has its batch: mid-step
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        proc.kill()
    # The orphaned rollout worker notices its trainer is gone and exits instead of generating for no one.
    worker = next(r["pid"] for r in _records(first) if r["event"] == "worker")
    killed_at = time.monotonic()
    while _running(worker):
        assert time.monotonic() < killed_at + 60, "the rollout worker outlived its killed trainer by 60 s"
        time.sleep(0.1)
    worker_exit_s = time.monotonic() - killed_at
    checkpoint = get_last_checkpoint(str(out))
    assert checkpoint is not None
    saved_step = int(checkpoint.rsplit("-", 1)[1])
    assert saved_step >= 3
    assert any(r["event"] == "begin" and r["step"] == saved_step + 1 for r in _records(first)), \
        "the kill came during the step after the checkpoint"

    proc = _run_script(out, second, vllm_server, tiny_model_dir, "--resume")
    try:
        assert proc.wait(400) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    finally:
        proc.kill()
    before = {row for r in _records(first) if r["event"] == "end" and r["step"] <= saved_step for row in r["rows"]}
    after_records = [r for r in _records(second) if r["event"] == "end"]
    after = {row for r in after_records for row in r["rows"]}
    assert [r["step"] for r in after_records] == list(range(saved_step + 1, 7)), "resumed at the next step"
    assert not before & after, f"prompts trained twice: {sorted(before & after)}"
    # Every prompt the final checkpoint counts as done was trained in one of the runs: none was lost
    # (rank_reward always has spread and max_staleness exceeds the run, so none was dropped).
    state = json.loads((out / "checkpoint-6" / "rollout_state.json").read_text())
    order = list(range(200))
    random.Random(42).shuffle(order)  # the epoch-0 order (AsyncGRPOConfig's seed 42)
    done = set(range(state["first_untrained_position"])) | set(state["done_positions"])
    assert {order[p] for p in done} <= before | after, "a done prompt was never trained"
    print(f"trainer SIGKILLed in step {saved_step + 1} (its worker exited {worker_exit_s:.1f} s later); resumed from "
          f"checkpoint-{saved_step}: {len(before)} prompts trained before it, {len(after)} after, 0 twice, "
          f"{len(done)} done and none missing")


# --------------------------------------------------------------------------- disk full while saving


def _used_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.fixture()
def small_disk(tmp_path: Path) -> Any:
    """A real tmpfs mounted for the test (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_disk_full_while_saving_keeps_the_previous_checkpoint_usable(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, small_disk: Path,
    restore_served_weights: WeightSynchronizer
) -> None:
    class FillTheDiskAfterTheFirstSave(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:  # leave 256 KiB: the next checkpoint (several MiB) cannot fit
                size = _used_bytes(small_disk) + (256 << 10)
                subprocess.run(["mount", "-o", f"remount,size={size}", str(small_disk)], check=True)

    out = small_disk / "out"
    args = _config(tmp_path, vllm_server, output_dir=str(out), save_strategy="steps", save_steps=1, max_steps=3,
                   save_total_limit=1)
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=rank_reward, train_dataset=_dataset(40),
                               args=args, callbacks=[FillTheDiskAfterTheFirstSave()])
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint-2 .* failed \(.*No space left on device.*"
                                                  r"the newest usable checkpoint is .*checkpoint-1") as info:
        trainer.train()
    print(f"disk full at checkpoint-2: {info.value}")
    assert trainer.worker is None
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".vllm")) == ["checkpoint-1"], \
        "no partial checkpoint-2 and no staging directory left"
    assert not (out / STAGING_DIR).exists()

    # checkpoint-1 is whole: the run resumes from it once there is room again.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    state = json.loads((out / "checkpoint-1" / "rollout_state.json").read_text())
    assert state["policy_version"] == 1
    AutoModelForCausalLM.from_pretrained(out / "checkpoint-1", dtype=torch.float32)
    resumed = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=rank_reward, train_dataset=_dataset(40),
                               args=_config(tmp_path, vllm_server, output_dir=str(out), max_steps=2))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2
    shutil.rmtree(out, ignore_errors=True)
