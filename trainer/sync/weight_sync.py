"""Trainer side of weight synchronisation: push the policy's weights into the running vLLM server.

One sync is vLLM's standard sequence, timed per phase::

    POST /pause?mode=keep&clear_cache=false   no new tokens; running requests keep their KV cache
    POST /start_weight_update
    POST /update_weights  (x chunks)          the backend moves the tensors
    POST /finish_weight_update                with the new policy version as weight_version
    POST /reset_prefix_cache                  cached prefixes were computed with the old weights
    POST /resume

The pause mode is ``weight_sync_pause``:

* ``"none"`` (backends that can take a whole update in one call: ``toolgym_shm``): no pause and no
  resume. Every chunk is written first, then one ``/update_weights`` call loads them all; vLLM's
  engine runs that call between two of its steps, so no step sees a half-loaded model, and
  generation stops only for the load itself. On other backends ``"none"`` pauses as ``"keep"``.
* ``"keep"`` (above).
* ``"reset"``: TRL's AsyncGRPOTrainer's pause, ``/pause?mode=keep``, whose default
  ``clear_cache=true`` resets the KV cache and so preempts every running request: each one
  recomputes its whole prefix after the sync (hundreds of prefills at once under load), and the
  pause itself grows with the requests it preempts.

Without ``"reset"`` the prefix-cache reset succeeds only when no request holds KV blocks (vLLM
refuses it otherwise), and running requests go on under the new weights with their KV cache; a
request that reuses an older prefix is still trained correctly, as its sampler log-probs are those
of the weights that produced it (``docs/pipeline.md``).

The backend that moves the tensors is the one the server runs (``--weight-transfer-config``),
taken from the table of :mod:`trainer.sync.backends`; :func:`trainer.sync.push_weights` does a
whole sync in one call.

Every tensor is checked against the served checkpoint's names and shapes *before*
``/start_weight_update``: a failure after that point leaves the server half-updated, so it is
raised as a :class:`~trainer.exceptions.WeightSyncError` and treated as fatal.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from trainer.exceptions import WeightSyncError
from trainer.vllm.admin import VLLMAdminClient

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
TensorSource = Iterable[tuple[str, torch.Tensor]]  # a list, or a stream gathered while sent (trainer.sync.gather)


def checkpoint_manifest(model_dir: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor in a checkpoint directory's safetensors files.

    Reads only the files' JSON headers. Returns an empty dict when the directory holds no
    safetensors file (then nothing can be checked ahead of the transfer).
    """
    manifest: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name != "__metadata__":
                manifest[name] = tuple(info["shape"])
    return manifest


def check_against_manifest(weights: NamedTensors, manifest: dict[str, tuple[int, ...]]) -> None:
    """Raise :class:`WeightSyncError` when ``weights`` and the served checkpoint disagree.

    Every sent name must exist with the same shape, and every checkpoint tensor must be sent (a
    partial update would silently mix two policies).
    """
    if not manifest:
        return
    sent = dict(weights)
    problems = [f"unknown tensor {n!r}" for n in sent if n not in manifest]
    problems += [
        f"tensor {n!r} has shape {list(t.shape)}, the served model has {list(manifest[n])}"
        for n, t in sent.items() if n in manifest and tuple(t.shape) != manifest[n]
    ]
    problems += [f"tensor {n!r} is missing from the update" for n in manifest if n not in sent]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise WeightSyncError(f"refusing to send weights that do not match the served model: {shown}")


def merged_lora_weights(model: torch.nn.Module) -> NamedTensors:
    """A PEFT LoRA model's weights with its active adapters merged in, by the base checkpoint's names.

    Computed out of place (base + the adapter's delta): ``merge_adapter`` then ``unmerge_adapter``
    would add and subtract the delta in the model's own weights, and the rounding would drift the
    frozen base a little at every sync. The streamed form (one tensor at a time, also from FSDP2
    shards) is :class:`trainer.sync.gather.PolicyWeights`.
    """
    from trainer.sync.gather import PolicyWeights

    return list(PolicyWeights(model))


class WeightSender(Protocol):
    """A backend that moves tensors into the server between start and finish (one per file in
    :mod:`trainer.sync.backends`)."""

    supports_whole_update: bool  # can load a whole update in one engine call (no pause needed)

    def init(self) -> None:
        """One-time handshake with the server."""

    def transfer(self, weights: TensorSource, version: int, whole_update: bool = False,
                 read_done: Callable[[], None] | None = None) -> None:
        """Run start -> update(s) -> finish(version) for ``weights``; with ``whole_update``, one
        update call loads everything (only where ``supports_whole_update``). ``read_done`` is called
        once ``weights`` are no longer read (the caller may change them from then on)."""


@dataclass
class SyncTimings:
    """Seconds spent in each phase of one sync (``perf/weight_sync_*``)."""

    pause_s: float
    transfer_s: float
    resume_s: float

    @property
    def total_s(self) -> float:
        """Whole sync."""
        return self.pause_s + self.transfer_s + self.resume_s


PAUSE_MODES = ("none", "keep", "reset")


class WeightSynchronizer:
    """Runs one sync: pause, transfer, finish with the version, reset prefix cache, resume.

    Args:
        client: The server's admin client.
        sender: The backend.
        manifest: Names and shapes of the served checkpoint (see :func:`checkpoint_manifest`);
            checked before anything reaches the server.
        pause_mode: ``"none"`` (the whole update in one engine call, no pause, where the backend
            can; else as ``"keep"``), ``"keep"`` (running requests keep their KV cache) or
            ``"reset"`` (TRL's AsyncGRPOTrainer's pause: the KV cache is cleared, preempting every
            running request).
    """

    def __init__(self, client: VLLMAdminClient, sender: WeightSender,
                 manifest: dict[str, tuple[int, ...]] | None = None, pause_mode: str = "none") -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode={pause_mode!r} is not one of {PAUSE_MODES}")
        if pause_mode == "none" and not sender.supports_whole_update:
            logger.info("weight_sync_pause='none': the %s backend loads chunk by chunk, so syncs pause "
                        "the server as 'keep'", type(sender).__name__)
            pause_mode = "keep"
        self.client = client
        self.sender = sender
        self.manifest = manifest or {}
        self.pause_mode = pause_mode
        self._initialised = False

    def sync(self, weights: Iterable[tuple[str, torch.Tensor]], version: int,
             read_done: Callable[[], None] | None = None) -> SyncTimings:
        """Push ``weights`` as policy ``version``; always resumes generation, raises on failure.
        ``read_done`` is called as soon as ``weights`` are no longer read (see :class:`WeightSender`)."""
        meta = getattr(weights, "meta", None)  # a streamed source (trainer.sync.gather) is checked on its
        if meta is None:                       # metadata and gathered chunk by chunk while it is sent
            weights = list(weights)
        check_against_manifest(meta() if meta is not None else list(weights), self.manifest)
        if not self._initialised:
            self.sender.init()
            self._initialised = True
        t0 = time.perf_counter()
        if self.pause_mode == "none":
            self.sender.transfer(weights, version, whole_update=True, read_done=read_done)
            self.client.reset_prefix_cache()
            return SyncTimings(pause_s=0.0, transfer_s=time.perf_counter() - t0, resume_s=0.0)
        self.client.pause("keep", clear_cache=self.pause_mode == "reset")
        t1 = time.perf_counter()
        try:
            self.sender.transfer(weights, version, read_done=read_done)
            self.client.reset_prefix_cache()
        finally:
            t2 = time.perf_counter()
            self.client.resume()
        return SyncTimings(pause_s=t1 - t0, transfer_s=t2 - t1, resume_s=time.perf_counter() - t2)
