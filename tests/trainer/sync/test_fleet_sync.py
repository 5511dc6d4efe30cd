"""Which servers a weight sync goes to (:class:`trainer.sync.fleet_sync.SyncTargets`), from the state shared with
the rollout worker (:class:`trainer.vllm.fleet.FleetState`, real shared memory), against HTTP servers on loopback
that answer ``/health`` as vLLM does (a stopped one refuses connections, as a killed vLLM does). The syncs
themselves run against real vLLM servers in ``tests/trainer/vllm/test_several_servers.py``."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.trainer.vllm.test_server_info import fake_vllm
from trainer.exceptions import VLLMServerError, WeightSyncError
from trainer.launch.vllm_server import free_port
from trainer.sync.fleet_sync import SyncTargets, Target
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.fleet import FleetState


def _targets(ports: list[int], version: int = 3) -> SyncTargets:
    fleet = FleetState.create(mp.get_context("spawn"), len(ports), version)
    return SyncTargets([VLLMAdminClient(f"http://127.0.0.1:{p}", timeout_s=5) for p in ports], fleet)


def test_servers_in_use_are_targets_without_a_health_probe() -> None:
    targets = _targets([free_port(), free_port()])  # nothing listens: no probe may be needed
    assert targets.plan() == [Target(0, 0, False), Target(1, 0, False)]


def test_a_server_the_worker_took_out_is_synced_again_only_once_it_answers_then_it_is_usable() -> None:
    ports = [free_port(), free_port()]
    targets = _targets(ports)
    fleet = targets.fleet
    assert fleet is not None
    fleet.take_out(1)  # the worker saw it fail for 5 s
    assert not fleet.usable(1)
    assert targets.plan() == [Target(0, 0, False)]  # down: skipped, marked lost
    assert fleet.version(1) == -1
    with fake_vllm(ports[1], {"/health": ""}):  # restarted
        plan = targets.plan()
    assert plan == [Target(0, 0, False), Target(1, 1, True)]
    for target in plan:
        targets.synced(target, 4)
    assert fleet.usable(1) and fleet.version(1) == 4


def test_a_server_lost_during_a_sync_is_left_behind_unless_it_still_answers_or_is_the_last() -> None:
    ports = [free_port(), free_port()]
    targets = _targets(ports)
    error = WeightSyncError("POST /start_weight_update could not reach the vLLM server")
    targets.failed(Target(1, 0, False), error, others_ok=True)  # gone: no /health either
    assert targets.fleet is not None and targets.fleet.version(1) == -1 and targets.lost_count == 1
    with pytest.raises(WeightSyncError):
        targets.failed(Target(0, 0, False), error, others_ok=False)  # the last one
    with fake_vllm(ports[0], {"/health": ""}), pytest.raises(WeightSyncError):
        targets.failed(Target(0, 0, False), error, others_ok=True)  # alive, its weights unknown: fatal


def test_no_server_left_is_the_clear_error() -> None:
    targets = _targets([free_port(), free_port()])
    assert targets.fleet is not None
    targets.fleet.take_out(0)
    targets.fleet.take_out(1)
    with pytest.raises(VLLMServerError, match="every vLLM server is gone"):
        targets.plan()
