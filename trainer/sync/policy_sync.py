"""The trainer's side of the weight sync, on every rank: which way the weights go, and when.

At start (:meth:`PolicySync.connect`) rank 0 picks the way for the whole run from what the server
said at start (:class:`~trainer.vllm.server_info.ServerInfo`): adapter-only when the model is a PEFT
LoRA model and the server loads adapters at run time (:mod:`trainer.sync.lora_sync`), else the full
weights (LoRA merged into them, :mod:`trainer.sync.weight_sync`) through the weight-transfer backend
the server runs (:mod:`trainer.sync.backends`). A sync that needs no pause
of the server runs on a thread while the next step goes on (:mod:`trainer.sync.background`). Under
FSDP2 every rank joins the gathers of each sync (:mod:`trainer.sync.gather`) and rank 0 sends.
With several servers every sync goes to each of them, a lost one is left behind and a returning one
synced in full before it gets rollouts (:mod:`trainer.sync.fleet_sync`).

Each sync adds ``perf/weight_sync_*`` metrics to the trainer's window; the new version reaches the
trainer, the stream and new rollouts through the ``publish`` callback.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from accelerate import Accelerator
from torch import nn

from trainer.config import AsyncGRPOConfig
from trainer.metrics import MetricWindow
from trainer.sync.backends import make_sender
from trainer.sync.background import BackgroundSync
from trainer.sync.fleet_sync import FleetSynchronizer, SyncTargets, Target
from trainer.sync.gather import PolicyWeights, adapter_state_dict, is_sharded
from trainer.sync.lora_sync import (
    LORA_CACHE_DIR,
    LoRAAdapterSync,
    adapter_rank,
    adapter_sync_obstacle,
    check_lora_limits,
    runtime_lora_limits,
)
from trainer.sync.weight_sync import SyncTimings, WeightSynchronizer, checkpoint_manifest
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.fleet import FleetState
from trainer.vllm.server_info import ServerInfo

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["PolicySync"]

logger = logging.getLogger(__name__)


class PolicySync:
    """Sends the policy's weights to the vLLM server as each new version, from one trainer process.

    Args:
        accelerator: The trainer's accelerator (its barrier, and the model inside its wrappers).
        model: Returns the trainer's current model (wrapped or not: FSDP2 wraps it after start).
        model_id: The model's directory or id; a directory gives the checkpoint's names and shapes,
            which every full sync is checked against.
        args: The trainer's config (``weight_sync_pause``, ``max_staleness``, ``output_dir``, the rank).
        frozen: Parameter names the server does not take (a vision tower left untrained).
        metrics: Where the ``perf/weight_sync_*`` metrics go.
        publish: Makes a version the trainer's policy version (called when the server has it).
    """

    def __init__(self, accelerator: Accelerator, model: Callable[[], nn.Module], model_id: str,
                 args: AsyncGRPOConfig, frozen: set[str], metrics: MetricWindow,
                 publish: Callable[[int], None]) -> None:
        self._accelerator = accelerator
        self._model = model
        self._model_id = model_id
        self._args = args
        self._frozen = frozen
        self._metrics = metrics
        self._publish = publish
        self._syncer: FleetSynchronizer | None = None  # full weights (rank 0), to every server
        self._targets: SyncTargets | None = None  # the servers each sync goes to (rank 0)
        self._background: BackgroundSync | None = None  # syncs overlapping the next step
        self.adapter: LoRAAdapterSync | None = None  # adapter-only sync (--enable-lora): rank 0, all under FSDP2
        self._wait_s = 0.0  # time blocked on syncs since the last take_wait_s

    @property
    def _rank_zero(self) -> bool:
        return bool(self._args.process_index == 0)

    def connect(self, admins: list[VLLMAdminClient], server: ServerInfo, sharded: bool,
                fleet: FleetState | None = None) -> None:
        """Pick the way of every sync of the run from ``server`` (the first server, read once at start;
        the servers agree), on rank 0; under FSDP2 (``sharded``) the other ranks learn it too (they
        gather an adapter or the weights with rank 0).

        Args:
            admins: Every server's admin client, in ``vllm_server_base_url`` order.
            server: What the first server said at start.
            sharded: FSDP2.
            fleet: The servers' state shared with the rollout worker (each sync marks the version
                each server holds); ``None``: every server always takes every sync.

        Raises:
            ConfigError: The server runs no weight-transfer backend the trainer can drive, or its LoRA
                limits do not fit the run (the message names the flag to restart it with).
        """
        if not self._rank_zero:
            if sharded:
                self.adapter = self._make_adapter_sync(admins, server)
            return
        self._targets = SyncTargets(admins, fleet)
        self.adapter = self._make_adapter_sync(admins, server)
        if self.adapter is None:
            def make(admin: VLLMAdminClient, index: int) -> WeightSynchronizer:
                return WeightSynchronizer(admin, make_sender(server.weight_transfer_backend, admin, index),
                                          self.manifest(), pause_mode=self._args.weight_sync_pause)

            self._syncer = FleetSynchronizer(self._targets, make)
            if self._syncer.pause_mode == "none" and not sharded:  # FSDP: every rank gathers, in step
                self._background = BackgroundSync()

    def _make_adapter_sync(self, admins: list[VLLMAdminClient], server: ServerInfo) -> LoRAAdapterSync | None:
        """Adapter-only sync when the model is a PEFT LoRA model and the server loads adapters at run
        time (limits checked here, with the flag to restart the server with); else ``None`` (merged)."""
        model = self._accelerator.unwrap_model(self._model())
        if not hasattr(model, "peft_config"):
            return None
        limits = runtime_lora_limits(server)
        if limits is None:
            return None
        obstacle = adapter_sync_obstacle(model)
        if obstacle is not None:
            logger.warning("LoRA: the server runs --enable-lora but the model has %s; using the merged-weight sync",
                           obstacle)
            return None
        check_lora_limits(limits, self._args.max_staleness, adapter_rank(model))
        cache = Path(cast(str, self._args.output_dir)) / LORA_CACHE_DIR  # set by TrainingArguments.__post_init__
        logger.info("LoRA: adapter-only sync (versions under %s, %d kept registered)",
                    cache, self._args.max_staleness + 1)
        return LoRAAdapterSync(admins, cache, f"toolgym-{uuid.uuid4().hex[:8]}", keep=self._args.max_staleness + 1)

    def manifest(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint's parameter names and shapes the server expects (empty for a model id that
        is not a directory), less the frozen ones."""
        manifest = checkpoint_manifest(self._model_id) if Path(self._model_id).is_dir() else {}
        return {name: shape for name, shape in manifest.items() if name not in self._frozen}

    def policy_weights(self) -> PolicyWeights:
        """The weights the server serves, by checkpoint name (LoRA merged into the base weights), gathered
        from the shards one at a time under FSDP2; the frozen vision tower is left out."""
        return PolicyWeights(self._accelerator.unwrap_model(self._model()), skip=self._frozen)

    def sync(self, version: int, barrier: bool = True, overlap: bool = False) -> None:
        """Push the weights as ``version`` (rank 0) once every rank finished its optimizer step; with
        ``overlap`` and a sync that needs no pause, on a thread while the next step goes on."""
        t0 = time.perf_counter()
        if barrier:
            self._accelerator.wait_for_everyone()
        self._metrics.add("perf/weight_sync_barrier_s", time.perf_counter() - t0)
        if overlap and self._background is not None and self._syncer is not None:
            self.wait()  # one sync at a time: the previous one ends first
            syncer, weights = self._syncer, self.policy_weights()

            def sync(read_done: Callable[[], None]) -> SyncTimings:
                timings = syncer.sync(weights, version, read_done)
                self._publish(version)  # at once: new rollouts start under the new version
                return timings

            self._background.start(sync)
            return
        timings: SyncTimings | None = None
        model = self._accelerator.unwrap_model(self._model())
        sharded = is_sharded(model)  # FSDP2: every rank joins the gathers, rank 0 sends (trainer.sync.gather)
        if self.adapter is not None:
            state_dict = adapter_state_dict(model) if sharded else None
            if self._rank_zero:
                timings = self._sync_adapter(model, version, state_dict)
                self._publish(version)  # new rollouts ask for the new adapter before the oldest goes
                timings.transfer_s += self.adapter.retire()
            else:
                self._publish(version)
        else:
            if self._syncer is not None:
                timings = self._syncer.sync(self.policy_weights(), version)
            elif sharded:
                self.policy_weights().drain()
            self._publish(version)
        if timings is not None:
            self._metrics.add("perf/weight_sync_pause_s", timings.pause_s)
            self._metrics.add("perf/weight_sync_transfer_s", timings.transfer_s)
        self._metrics.add("perf/weight_sync_s", time.perf_counter() - t0)
        self._wait_s += time.perf_counter() - t0

    def _sync_adapter(self, model: nn.Module, version: int, state_dict: dict[str, Any] | None) -> SyncTimings:
        """Write the adapter as ``version`` and register it on every target server (rank 0)."""
        assert self.adapter is not None and self._targets is not None
        t0 = time.perf_counter()
        targets = self._targets.plan()
        self.adapter.write(cast("PeftModel", model), version, state_dict)
        failures: list[tuple[Target, Exception]] = []
        for target in targets:
            if target.returning:
                self.adapter.forget(target.index)
            try:
                self.adapter.register(target.index, version)
            except Exception as exc:  # noqa: BLE001 - SyncTargets.failed raises it unless the server is lost
                failures.append((target, exc))
            else:
                self._targets.synced(target, version)
        for target, error in failures:
            self._targets.failed(target, error, others_ok=len(failures) < len(targets))
        return SyncTimings(pause_s=0.0, transfer_s=time.perf_counter() - t0, resume_s=0.0)

    def wait(self, block: bool = True) -> None:
        """Wait for an overlapped sync: until it ends, or (``block=False``) only until it no longer
        reads the weights; log it once it ended. Raises its error."""
        background = self._background
        if background is None or not background.pending:
            return
        t0 = time.perf_counter()
        if not block:
            background.wait_for_read()
        finished = background.collect(block)
        self._wait_s += time.perf_counter() - t0
        if finished is not None:
            self._metrics.add("perf/weight_sync_pause_s", finished.timings.pause_s)
            self._metrics.add("perf/weight_sync_transfer_s", finished.timings.transfer_s)
            self._metrics.add("perf/weight_sync_s", finished.duration_s)

    def take_wait_s(self) -> float:
        """Seconds blocked on syncs since the last call (``perf/weight_sync_wait_s`` of a step)."""
        wait_s, self._wait_s = self._wait_s, 0.0
        return wait_s

    def stop_overlapped(self) -> None:
        """End the thread of overlapped syncs (before the rollout worker stops)."""
        if self._background is not None:
            self._background.close()
            self._background = None

    def close(self) -> None:
        """Unregister the adapters (rank 0; after the rollout worker stopped, so no rollout still asks
        for one)."""
        if self.adapter is not None and self._rank_zero:
            self.adapter.close()
            self.adapter = None
