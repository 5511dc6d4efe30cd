"""Multi-process training: rank 0 feeds every other rank.

Only rank 0 runs the rollout worker, the :class:`~trainer.training.batching.MicroBatchStream`, the server
queries and the weight sync. Before each optimizer step it sends the step's micro-batches (every
row: a :class:`~trainer.training.batching.MicroBatch` holds one row per process), the stream's progress and
the policy version to the other ranks, each of which forwards its own row. The data travels over a
gloo group (CPU tensors, whatever backend trains), started only once rank 0 has announced it in the
``torch.distributed`` store, so a peer waits for a slow rollout without any collective timing out.

Peers wait for rank 0 twice: once at start, until its rollout worker runs (:meth:`StepFeed.wait_ready`,
before the training loop's first collective), then before each step. Failure handling, so that no
rank is left behind:

* rank 0 raising (a rollout worker failure, a weight sync error...) puts the exception in the
  store; a waiting peer re-raises it;
* rank 0 vanishing (killed, out of memory, host gone) stops its heartbeat, a counter that a thread
  of rank 0 bumps in the store; a peer that sees it frozen for ``timeout_s``
  (``rollout_worker_timeout``), or cannot reach the store any more, raises
  :class:`RankZeroLostError`.

A peer blocked in another collective (the gradient all-reduce, a barrier) is covered by the
process group's own timeout (``ddp_timeout``); ``torchrun`` also stops every rank when one exits
with an error.
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from trainer.exceptions import RankZeroLostError, TrainerError
from trainer.training.batching import MicroBatch
from trainer.training.loss import STAT_REDUCTIONS

__all__ = ["RankZeroLostError", "StepFeed", "StepPayload", "all_reduce_loss_stats"]

_KEY = "toolgym/feed"
POLL_S = 0.05


@dataclass
class StepPayload:
    """What rank 0 sends the other ranks before each optimizer step.

    Attributes:
        micro_batches: The step's micro-batches (every row; each rank forwards ``rows[rank]``).
        epoch_done: Whether the stream finished its epochs with this step (every rank stops).
        first_untrained: The stream's first untrained prompt position (the epoch counter).
        policy_version: The policy version the step trains.
    """

    micro_batches: list[MicroBatch]
    epoch_done: bool
    first_untrained: int
    policy_version: int


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


class StepFeed:
    """The channel from rank 0 to the other ranks; every rank builds one, at the same point.

    Args:
        timeout_s: Seconds a peer waits with rank 0's heartbeat frozen before giving up.
        heartbeat_s: Seconds between two beats of rank 0; at most a tenth of ``timeout_s``.
        group_timeout_s: Timeout of the gloo group's collectives (they start only once rank 0 is
            ready, so this bounds a transfer, not a wait for rollouts).
    """

    def __init__(self, timeout_s: float, heartbeat_s: float = 5.0, group_timeout_s: float = 1800.0) -> None:
        if not dist.is_initialized():
            raise TrainerError("StepFeed needs torch.distributed to be initialised (launch with torchrun)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_s = timeout_s
        self._heartbeat_s = min(heartbeat_s, timeout_s / 10)
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=group_timeout_s))
        self._store = _store()
        self._sent = 0
        self._received = 0
        self.last: StepPayload | None = None  # the payload received last (peers)
        self._pending: list[MicroBatch] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.rank == 0:
            self._store.delete_key(f"{_KEY}/error")
            self._store.set(f"{_KEY}/ready", "0")
            self._store.set(f"{_KEY}/seq", "0")
            self._store.set(f"{_KEY}/beat", "0")
            self._thread = threading.Thread(target=self._beat, args=(self._store.clone(),),
                                             name="toolgym-rank0-heartbeat", daemon=True)
            self._thread.start()
        dist.barrier(group=self._group)

    def _beat(self, store: Any) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                store.add(f"{_KEY}/beat", 1)
            except Exception:  # the store is gone: the run is ending, peers will notice
                return

    # ------------------------------------------------------------------------------ rank 0
    def mark_ready(self) -> None:
        """Rank 0: the rollout worker runs; peers waiting in :meth:`wait_ready` go on."""
        self._store.set(f"{_KEY}/ready", "1")

    def send(self, payload: StepPayload) -> None:
        """Rank 0: announce the next payload, then broadcast it to every rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)
        self._sent += 1
        self._store.set(f"{_KEY}/seq", str(self._sent))
        size = torch.tensor([data.numel()], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._group)
        dist.broadcast(data, src=0, group=self._group)

    def fail(self, exc: BaseException) -> None:
        """Rank 0: tell the peers why it stopped (they re-raise it); never blocks on them."""
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)
        except Exception:
            blob = pickle.dumps(TrainerError(f"rank 0 failed: {type(exc).__name__}: {exc}"))
        try:
            self._store.set(f"{_KEY}/error", blob)
        except Exception:  # nothing more to do: the peers fall back on the heartbeat
            pass

    # ------------------------------------------------------------------------------ peers
    def __iter__(self) -> StepFeed:
        return self

    def __next__(self) -> MicroBatch:
        """A peer's data loader: the micro-batches of rank 0's payloads, one at a time (the payload
        they came in stays in :attr:`last`)."""
        if not self._pending:
            self.last = self.receive()
            self._pending = list(self.last.micro_batches)
        return self._pending.pop(0)

    def wait_ready(self) -> None:
        """A peer: wait until rank 0 started its rollout worker (or failed to), before any
        collective of the training loop (a failure at start then reaches the peers at once)."""
        self._wait_for("ready", 1)

    def receive(self) -> StepPayload:
        """A peer: wait for rank 0's next payload (or its failure) and return it."""
        self._received += 1
        self._wait_for("seq", self._received)
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self._group)
        return cast(StepPayload, pickle.loads(data.numpy().tobytes()))

    def _wait_for(self, key: str, value: int) -> None:
        """Poll until the store's ``key`` reaches ``value``, re-raising rank 0's error, and raising
        :class:`RankZeroLostError` when its heartbeat freezes or the store goes away."""
        last_beat, last_change = -1, time.monotonic()
        while True:
            try:
                error = self._store.get(f"{_KEY}/error") if self._store.check([f"{_KEY}/error"]) else None
                reached = int(self._store.get(f"{_KEY}/{key}")) >= value
                beat = self._store.add(f"{_KEY}/beat", 0)
            except Exception as exc:
                raise RankZeroLostError(f"rank {self.rank} lost rank 0 while waiting for step data: the "
                                        f"store is unreachable ({type(exc).__name__}: {exc})") from exc
            if error is not None:
                raised = pickle.loads(error)
                raised.add_note(f"(raised on rank 0; rank {self.rank} stops with it)")
                raise raised
            if reached:
                return
            now = time.monotonic()
            if beat != last_beat:
                last_beat, last_change = beat, now
            elif now - last_change > self.timeout_s:
                raise RankZeroLostError(
                    f"rank {self.rank}: rank 0 sent no heartbeat for {now - last_change:.0f} s "
                    f"(rollout_worker_timeout={self.timeout_s:.0f}); it died or is stuck, stopping")
            time.sleep(POLL_S)

    def close(self) -> None:
        """Stop the heartbeat (rank 0); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


def all_reduce_loss_stats(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Combine one rank's loss statistics with every other rank's (per ``STAT_REDUCTIONS``).

    Every rank must call it with the same keys (they come from the same ``grpo_loss``).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1 or not stats:
        return stats
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    out = dict(stats)
    for rule, op in ops.items():
        keys = sorted(k for k in stats if STAT_REDUCTIONS[k] == rule)
        if not keys:
            continue
        packed = torch.stack([stats[k].detach().float() for k in keys])
        dist.all_reduce(packed, op=op)
        out.update(zip(keys, packed.unbind(), strict=True))
    return out
