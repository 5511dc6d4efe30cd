"""Training over two real vLLM CPU servers: rollouts spread evenly, every sync reaching both, one server killed
mid-run (the run goes on, its rollouts start over on the other, none trained twice) and restarted in the same run
(synced to the current policy before it gets a rollout).

Real components only: the two servers are ``vllm serve`` processes of the tiny model (``two_vllm_servers``,
started once per session), killed with SIGKILL to their process group as a crash would, restarted on the same
port; the trainer and its spawned rollout worker are the real ones. What the tests read: each server's own
``/metrics`` and ``/weight_info``, the trainer's logs, the state the trainer shares with its worker
(:class:`trainer.vllm.fleet.FleetState`), and the samples the trainer placed in its rows (the stream keeps
them with ``log_completions``; the test records them as the trainer takes them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from tests.trainer.spread_reward import token_reward
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer
from trainer.metrics import RecordBuffer
from trainer.records import TrainingSample
from trainer.rollout.servers import ServerFleet
from trainer.rollout.settings import RolloutSettings
from trainer.sync import weight_synchronizer
from trainer.training.batching import MicroBatchStream
from trainer.vllm.client import SamplingParams
from trainer.vllm.prometheus import parse_prometheus

# Each test may start servers: the session's two at once (1-4 min on a busy 2-core machine), or a successor.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

NUM_GENERATIONS = 4


def _config(tmp_path: Path, servers: list[VLLMServer], **overrides: Any) -> AsyncGRPOConfig:
    kwargs: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=",".join(s.base_url for s in servers), max_steps=4,
        num_generations=NUM_GENERATIONS, max_completion_length=16, learning_rate=1e-3, report_to="none",
        use_cpu=True, gradient_checkpointing=False, save_strategy="no", logging_steps=1, rollout_worker_timeout=120,
        vllm_server_timeout=120, disable_tqdm=True, log_completions=True, num_completions_to_print=None,
    )
    kwargs.update(overrides)
    return AsyncGRPOConfig(**kwargs)


def _dataset(n: int = 64) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(n)],
                              "row_id": list(range(n))})


def _get(url: str, timeout_s: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


def _requests_seen(server: VLLMServer) -> float:
    """Requests the server finished or is running, from its own ``/metrics`` (0 while it does not answer)."""
    try:
        samples = parse_prometheus(_get(f"{server.base_url}/metrics"))
    except OSError:
        return 0.0
    return sum(v for name, _, v in samples if name in ("vllm:request_success_total", "vllm:num_requests_running"))


def _weight_version(server: VLLMServer) -> str | None:
    version = json.loads(_get(f"{server.base_url}/weight_info"))["weight_version"]
    return None if version is None else str(version)


def _total(trainer: AsyncGRPOTrainer, name: str) -> float:
    return sum(h.get(name, 0.0) for h in trainer.state.log_history)


def _kill(server: VLLMServer) -> None:
    """SIGKILL the server's whole process group, as a crash of the machine's server would."""
    assert server.process is not None
    os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)


def _successor(server: VLLMServer) -> VLLMServer:
    """A new server on the same port (the old one's process is reaped and its folder removed)."""
    server.stop()
    return VLLMServer(dataclasses.replace(server.config, port=server.port))


@pytest.fixture()
def servers(two_vllm_servers: list[VLLMServer], tiny_model_dir: Path) -> Iterator[list[VLLMServer]]:
    """The session's two servers; each gets the checkpoint's weights back afterwards (as version 0)."""
    yield two_vllm_servers
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for server in two_vllm_servers:
        weight_synchronizer(server.base_url, tiny_model_dir).sync(original.named_parameters(), version=0)


@pytest.fixture()
def trained_samples(monkeypatch: pytest.MonkeyPatch) -> list[TrainingSample]:
    """Every sample the trainer placed in a row, in order (recorded as the trainer takes them to log)."""
    taken: list[TrainingSample] = []
    original = MicroBatchStream.take_trained_samples

    def recording(self: MicroBatchStream) -> list[TrainingSample]:
        samples = original(self)
        taken.extend(samples)
        return samples

    monkeypatch.setattr(MicroBatchStream, "take_trained_samples", recording)
    return taken


class _StopWhen(TrainerCallback):
    """Stops training at the end of the step during which ``event`` was set."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.event.is_set():
            control.should_training_stop = True


def test_equal_load_is_split_evenly_between_the_two_servers(servers: list[VLLMServer], tiny_model_dir: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Waves of rollouts through the worker's ServerFleet, each wave starting with both servers idle (equal load,
    whatever else the machine runs): the servers' own counts of requests are within 20 % of even."""
    settings = RolloutSettings.from_server(",".join(s.base_url for s in servers), str(tiny_model_dir))
    fleet = ServerFleet(settings, RecordBuffer())
    params = SamplingParams(max_tokens=8)

    async def waves() -> None:
        try:
            for _ in range(10):
                await asyncio.gather(*(fleet.run_routed(lambda i: fleet.complete([5, 17, 42], params))
                                       for _ in range(7)))  # odd: the tie-break on rollouts routed decides
        finally:
            await fleet.close()

    before = [_requests_seen(s) for s in servers]
    asyncio.run(waves())
    served = [_requests_seen(s) - b for s, b in zip(servers, before, strict=True)]
    with capsys.disabled():
        print(f"\nequal load: requests per server {served}")
    even = sum(served) / 2
    assert sum(served) == 70 and all(abs(n - even) <= 0.2 * even for n in served), served


def test_a_run_over_two_servers_uses_both_and_every_sync_reaches_both(
    servers: list[VLLMServer], tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A training run: the router sends each rollout to the server with fewer in flight, so a server that the
    machine slows (two engines, a trainer and its worker on two cores) gets fewer; both get a real share."""
    before = [_requests_seen(s) for s in servers]
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=token_reward, train_dataset=_dataset(),
                               args=_config(tmp_path, servers, max_steps=4))
    trainer.train()
    served = [_requests_seen(s) - b for s, b in zip(servers, before, strict=True)]
    routed = [_total(trainer, f"vllm/{i}/rollouts_routed_count") for i in range(2)]
    with capsys.disabled():
        print(f"\ntraining run: requests per server {served}; rollouts routed (logged): {routed}")
    assert min(served) >= 0.1 * sum(served), served
    assert [_weight_version(s) for s in servers] == ["4", "4"], "every sync reaches every server"
    seen = set().union(*(h.keys() for h in trainer.state.log_history))
    for name in ("vllm/0/rollouts_routed_count", "vllm/1/rollouts_routed_count", "vllm/servers_up",
                 "vllm/0/kv_cache_usage_frac", "vllm/1/concurrency_cap", "rollout/vllm_running_requests"):
        assert name in seen, f"{name} is not logged"


def _running(server: VLLMServer) -> bool:
    try:
        samples = parse_prometheus(_get(f"{server.base_url}/metrics"))
    except OSError:
        return False
    return sum(v for name, _, v in samples if name == "vllm:num_requests_running") > 0


def test_a_server_killed_mid_run_is_left_behind_then_synced_before_use_when_it_comes_back(
    servers: list[VLLMServer], tiny_model_dir: Path, tmp_path: Path, trained_samples: list[TrainingSample],
    capsys: pytest.CaptureFixture[str]
) -> None:
    """One run: the second server is killed while it generates (taken out within seconds, its rollouts in flight
    start over on the other, none trained twice), then a new server is started on its port (synced to the
    current policy before it gets a rollout, then given rollouts). One run and one restart for both halves:
    each vLLM start is most of a minute on this machine."""
    done = threading.Event()
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=token_reward, train_dataset=_dataset(),
                               args=_config(tmp_path, servers, max_steps=400), callbacks=[_StopWhen(done)])
    seen: dict[str, Any] = {}

    def kill_restart_and_watch() -> None:
        try:
            while not (trainer.state.global_step >= 1 and trainer.worker is not None):
                time.sleep(0.05)
            fleet = trainer.worker.channels.fleet
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not _running(servers[1]):
                time.sleep(0.02)
            _kill(servers[1])
            killed = time.monotonic()
            while fleet.usable(1) and time.monotonic() < killed + 60:
                time.sleep(0.05)
            seen["taken_out_s"] = time.monotonic() - killed
            seen["retried_by_then"] = _total(trainer, "rollout/server_retry_count")
            servers[1] = successor = _successor(servers[1]).start(wait=False)
            deadline = time.monotonic() + 420
            while time.monotonic() < deadline:
                requests = _requests_seen(successor)  # read before usable: a request seen then came first
                if fleet.usable(1):
                    seen.update(back_s=time.monotonic() - killed, version=fleet.version(1),
                                served_version=_weight_version(successor), requests_before=requests,
                                trainer_version=trainer.stream.policy_version if trainer.stream else None)
                    break
                if requests > 0:
                    seen["early_requests"] = requests
                time.sleep(0.05)
            while time.monotonic() < deadline and _requests_seen(successor) == 0:
                time.sleep(0.1)
            seen["served_after_back"] = _requests_seen(successor)
        finally:
            done.set()

    watcher = threading.Thread(target=kill_restart_and_watch, daemon=True)
    watcher.start()
    trainer.train()
    watcher.join(30)
    retried = _total(trainer, "rollout/server_retry_count")
    lost = _total(trainer, "vllm/servers_lost_count")
    with capsys.disabled():
        print(f"\nkilled: taken out {seen.get('taken_out_s', float('nan')):.1f} s after the kill; {retried:.0f} "
              f"rollouts started over; servers lost: {lost:.0f}; restart: {seen}")
    # The kill: taken out within seconds, its rollouts in flight started over, the run went on.
    assert seen["taken_out_s"] < 15, "taken out within seconds"
    assert retried >= 1 and lost >= 1, "the killed server's rollouts in flight start over on the other"
    assert trainer.state.global_step > 1, "the run goes on with the other server"
    ids = [s.rollout_id for s in trained_samples]
    assert ids and len(ids) == len(set(ids)), "a rollout's sample is trained once"
    per_group: dict[int, set[str]] = {}
    for sample in trained_samples:
        per_group.setdefault(sample.group_id, set()).add(sample.rollout_id)
    assert max(len(r) for r in per_group.values()) <= NUM_GENERATIONS, "no half-kept attempt joins a group"
    # The restart: no rollout before its sync, and it holds the policy the trainer had then (a next sync may
    # have landed before /weight_info was read).
    assert "early_requests" not in seen and seen["requests_before"] == 0, "no rollout before its sync"
    assert seen["version"] >= 1 and int(seen["served_version"]) >= seen["version"], seen
    assert seen["trainer_version"] is not None and seen["version"] >= seen["trainer_version"], \
        "synced to the current policy, not an older one"
    assert seen["served_after_back"] > 0, "it gets rollouts once synced"
