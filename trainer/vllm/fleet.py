"""Which of the run's vLLM servers hold which policy: shared memory between the trainer and the rollout worker.

The trainer syncs the weights into every server; the rollout worker routes rollouts to them and is
the first to see one stop answering. :class:`FleetState` is what both need to agree on, three
arrays of one integer per server, each with one writer (no lock):

* ``versions`` (the trainer): the policy version server ``i`` was last synced to; ``-1`` when the
  trainer found it gone (a sync to it failed and it did not answer ``/health``).
* ``taken_out`` (the worker): how many times the worker took server ``i`` out (it failed every
  request for a few seconds, :class:`~trainer.vllm.routing.ServerRouter`).
* ``synced_after`` (the trainer): the ``taken_out`` count it had seen when it last synced server ``i``.

A server gets rollouts only while it is *usable*: synced (``versions >= 0``) since its last take-out
(``synced_after == taken_out``). So a server the worker took out, restarted by someone, gets work
again only after a sync of the trainer has brought it to the current policy
(:meth:`trainer.sync.policy_sync.PolicySync.sync` tries such servers at every sync), and each
rollout records the version of the server it ran on (``versions[i]`` when it started).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

__all__ = ["FleetState"]


@dataclass
class FleetState:
    """The servers' shared state (module docstring); picklable for the worker's spawn.

    Attributes:
        versions: Per server, the policy version it holds (``-1``: none the trainer vouches for).
        taken_out: Per server, how many times the rollout worker took it out.
        synced_after: Per server, the ``taken_out`` count seen by the trainer's last sync of it.
    """

    versions: Any  # ctypes arrays of c_int64 (multiprocessing RawArray)
    taken_out: Any
    synced_after: Any

    @classmethod
    def create(cls, ctx: BaseContext, servers: int, version: int) -> FleetState:
        """The state of ``servers`` servers that all hold ``version`` (at the start of a run)."""
        return cls(versions=ctx.RawArray(ctypes.c_int64, [version] * servers),
                   taken_out=ctx.RawArray(ctypes.c_int64, servers),
                   synced_after=ctx.RawArray(ctypes.c_int64, servers))

    def __len__(self) -> int:
        return len(self.versions)

    def usable(self, i: int) -> bool:
        """Whether server ``i`` may take rollouts: synced since the worker last took it out."""
        return int(self.versions[i]) >= 0 and int(self.synced_after[i]) == int(self.taken_out[i])

    def version(self, i: int) -> int:
        """The policy version server ``i`` holds (``-1``: unknown)."""
        return int(self.versions[i])

    # ---------------------------------------------------------------- the worker writes
    def take_out(self, i: int) -> None:
        """The worker took server ``i`` out: it gets no rollouts until the trainer syncs it again."""
        self.taken_out[i] += 1

    # ---------------------------------------------------------------- the trainer writes
    def needs_sync(self, i: int) -> bool:
        """Whether server ``i`` is out (taken out by the worker, or found gone by a sync) and must be
        synced in full before it gets work again."""
        return not self.usable(i)

    def mark_synced(self, i: int, version: int, taken_out_seen: int) -> None:
        """Server ``i`` now holds ``version``, synced after the worker's ``taken_out_seen``-th take-out."""
        self.versions[i] = version
        self.synced_after[i] = taken_out_seen

    def mark_lost(self, i: int) -> None:
        """A sync found server ``i`` gone: no rollout goes there until a later sync brings it back."""
        self.versions[i] = -1
