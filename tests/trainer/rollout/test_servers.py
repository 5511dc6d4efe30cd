"""The worker's side of several servers (:class:`trainer.rollout.servers.ServerFleet`): a rollout bound to one
server, started over whole on another when that server is taken out, a server back only once the trainer synced
it. The routing decisions only: no request is sent here (the rollouts are coroutines that wait), real vLLM
servers are in ``tests/trainer/vllm/test_several_servers.py``."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest

from trainer.exceptions import VLLMServerError
from trainer.metrics import RecordBuffer
from trainer.rollout.servers import ServerFleet, rollout_server
from trainer.rollout.settings import RolloutSettings
from trainer.vllm.fleet import FleetState
from trainer.vllm.server_info import ServerInfo

URLS = "http://127.0.0.1:9,http://127.0.0.1:10"


def _fleet(state: FleetState | None = None) -> ServerFleet:
    settings = RolloutSettings(model_name="unused", vllm_server_base_url=URLS,
                               server=ServerInfo(model="unused", max_model_len=2048))
    return ServerFleet(settings, RecordBuffer(), state)


def _counts(fleet: ServerFleet) -> dict[str, float]:
    counts: dict[str, float] = {}
    for _, name, value, _ in fleet.records.take():
        counts[name] = counts.get(name, 0.0) + value
    return counts


def test_a_rollout_is_bound_to_one_server_and_starts_over_whole_on_another_when_it_is_taken_out() -> None:
    fleet = _fleet()
    attempts: list[int] = []
    started = asyncio.Event()

    async def rollout(server: int) -> str:
        attempts.append(server)
        assert rollout_server() == server  # every turn of the attempt goes there
        if len(attempts) == 1:
            started.set()
            await asyncio.sleep(3600)  # the first server stops answering mid-rollout
        return f"done on {server}"

    async def scenario() -> str:
        task = asyncio.create_task(fleet.run_routed(rollout))
        await started.wait()
        fleet._take_out(attempts[0], "killed")
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(scenario()) == f"done on {1 - attempts[0]}"
    assert fleet.retried_rollouts == 1 and fleet.router.in_flight == [0, 0]
    counts = _counts(fleet)
    assert counts["rollout/server_retry_count"] == 1 and counts["vllm/servers_lost_count"] == 1


def test_a_server_taken_out_comes_back_only_after_the_trainer_synced_it() -> None:
    state = FleetState.create(mp.get_context("spawn"), 2, 5)
    fleet = _fleet(state)
    fleet._take_out(0, "killed")
    assert state.taken_out[0] == 1 and not state.usable(0)
    fleet.refresh()
    assert fleet.router.up == [False, True], "not back before a sync"
    state.mark_synced(0, 6, taken_out_seen=1)  # the trainer's next sync reached it
    fleet.refresh()
    assert fleet.router.up == [True, True] and fleet.version(0, newest=0) == 6


def test_a_server_a_sync_found_gone_is_taken_out_and_losing_the_last_is_the_error() -> None:
    state = FleetState.create(mp.get_context("spawn"), 2, 0)
    fleet = _fleet(state)
    state.mark_lost(1)
    fleet.refresh()
    assert fleet.router.up == [True, False] and state.taken_out[1] == 0  # the trainer knows already
    with pytest.raises(VLLMServerError, match="last vLLM server, http://127.0.0.1:9, stopped answering"):
        fleet._take_out(0, "killed")
