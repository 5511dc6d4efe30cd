"""Every weight sync to every vLLM server of the run, a lost server left behind, a returning one caught up.

:class:`SyncTargets` decides, at each sync, which servers it goes to, from the state the trainer
shares with the rollout worker (:class:`~trainer.vllm.fleet.FleetState`): every server in use, and
every server that is out (the worker took it out, or an earlier sync found it gone) but answers
``/health`` again. Such a server is synced in full, through a fresh sender (a restarted server needs
the backend's handshake again), and only then marked usable, with the version it now holds: it gets
rollouts only after that. A server that fails its sync and no longer answers ``/health`` is marked
lost and the run goes on without it; a server that fails while it still answers, or the failure of
the last server, stops the run as a failed sync always did (a live server whose update failed holds
weights nobody knows).

:class:`FleetSynchronizer` is the full-weight sync over them (the same ``sync`` as
:class:`~trainer.sync.weight_sync.WeightSynchronizer`): with one target, that server's synchroniser
as before; with several, one pass over the weights feeds every server's sync on its own thread
(:func:`~trainer.sync.fan_out.fan_out`), so FSDP2's gathers run once per sync. The adapter-only LoRA
sync goes to the same targets (:mod:`trainer.sync.policy_sync`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from trainer.exceptions import VLLMServerError
from trainer.sync.fan_out import ReadDone, fan_out
from trainer.sync.weight_sync import SyncTimings, TensorSource, WeightSynchronizer
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.fleet import FleetState

__all__ = ["FleetSynchronizer", "SyncTargets", "Target"]

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0


def answers_health(admin: VLLMAdminClient, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether the server at ``admin`` answers ``/health`` (without an HTTP error) within ``timeout_s``."""
    try:
        admin.request("GET", "/health", timeout_s=timeout_s)
    except VLLMServerError:
        return False
    return True


@dataclass(frozen=True)
class Target:
    """One server a sync goes to.

    Attributes:
        index: The server's place in ``vllm_server_base_url``.
        taken_out_seen: The worker's take-out count when the sync was planned (:meth:`FleetState.mark_synced`).
        returning: Whether it is out and comes back with this sync (synced in full, through a fresh sender).
    """

    index: int
    taken_out_seen: int
    returning: bool


class SyncTargets:
    """The servers of the run as the trainer's syncs see them (module docstring).

    Args:
        admins: Each server's admin client, in ``vllm_server_base_url`` order.
        fleet: The state shared with the rollout worker; ``None`` until the worker's channels exist
            (then every server is a target).
    """

    def __init__(self, admins: list[VLLMAdminClient], fleet: FleetState | None = None) -> None:
        self.admins = admins
        self.fleet = fleet
        self.lost_count = 0  # servers a sync found gone, since the start

    def plan(self) -> list[Target]:
        """The servers this sync goes to: those in use, and those out that answer ``/health`` again.

        Raises:
            VLLMServerError: No server is in use or answering.
        """
        fleet = self.fleet
        if fleet is None or len(self.admins) == 1:
            return [Target(i, int(fleet.taken_out[i]) if fleet else 0, False) for i in range(len(self.admins))]
        targets = []
        for i, admin in enumerate(self.admins):
            seen = int(fleet.taken_out[i])
            if not fleet.needs_sync(i):
                targets.append(Target(i, seen, False))
            elif answers_health(admin):
                logger.warning("vLLM server %d (%s) answers again: it is synced in full before it gets rollouts",
                               i, admin.base_url)
                targets.append(Target(i, seen, True))
            else:
                fleet.mark_lost(i)
        if not targets:
            raise VLLMServerError("every vLLM server is gone: " + ", ".join(a.base_url for a in self.admins))
        return targets

    def synced(self, target: Target, version: int) -> None:
        """``target`` now holds ``version``: it may take rollouts (again)."""
        if self.fleet is not None:
            self.fleet.mark_synced(target.index, version, target.taken_out_seen)

    def failed(self, target: Target, error: BaseException, others_ok: bool) -> None:
        """``target``'s sync raised ``error``: lost when it no longer answers and another server took
        the sync (``others_ok``), else ``error`` is raised."""
        admin = self.admins[target.index]
        if self.fleet is None or len(self.admins) == 1 or not others_ok or answers_health(admin):
            raise error
        self.fleet.mark_lost(target.index)
        self.lost_count += 1
        logger.warning("vLLM server %d (%s) was lost during a weight sync (%s); the run goes on without it "
                       "until it answers again", target.index, admin.base_url, error)


class FleetSynchronizer:
    """The full-weight sync to every target server (module docstring).

    Args:
        targets: The servers.
        make: Builds a server's synchroniser from its admin client and its sender's index (the NCCL
            backend's rendezvous port offset: a new one for a server that comes back).
    """

    def __init__(self, targets: SyncTargets, make: Callable[[VLLMAdminClient, int], WeightSynchronizer]) -> None:
        self.targets = targets
        self._make = make
        self.syncers = [make(admin, i) for i, admin in enumerate(targets.admins)]
        self.pause_mode = self.syncers[0].pause_mode
        self._returns = 0

    def sync(self, weights: TensorSource, version: int, read_done: ReadDone | None = None) -> SyncTimings:
        """Push ``weights`` as ``version`` to every target; the slowest server's phases are returned."""
        plan = self.targets.plan()
        for target in plan:
            if target.returning:  # a fresh sender: a restarted server needs the backend's handshake again
                self._returns += 1
                index = target.index + len(self.syncers) * self._returns
                self.syncers[target.index] = self._make(self.targets.admins[target.index], index)
        if len(plan) == 1:
            target = plan[0]
            try:
                timings = self.syncers[target.index].sync(weights, version, read_done)
            except Exception as exc:
                self.targets.failed(target, exc, others_ok=False)
                raise
            self.targets.synced(target, version)
            return timings

        def consumer(i: int) -> Callable[[TensorSource, ReadDone], SyncTimings]:
            return lambda branch, done: self.syncers[i].sync(branch, version, done)

        results = fan_out(weights, [consumer(t.index) for t in plan], read_done)
        ok = [r for r in results if isinstance(r, SyncTimings)]
        for target, result in zip(plan, results, strict=True):
            if isinstance(result, SyncTimings):
                self.targets.synced(target, version)
            else:
                self.targets.failed(target, result, others_ok=bool(ok))
        return SyncTimings(pause_s=max(t.pause_s for t in ok), transfer_s=max(t.transfer_s for t in ok),
                           resume_s=max(t.resume_s for t in ok))
