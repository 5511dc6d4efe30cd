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
* ``"reset"``: the source's ``/pause?mode=keep``, whose default ``clear_cache=true`` resets the KV
  cache and so preempts every running request: each one recomputes its whole prefix after the
  sync (hundreds of prefills at once under load), and the pause itself grows with the requests it
  preempts.

Without ``"reset"`` the prefix-cache reset succeeds only when no request holds KV blocks (vLLM
refuses it otherwise), and running requests go on under the new weights with their KV cache; a
request that reuses an older prefix is still trained correctly, as its sampler log-probs are those
of the weights that produced it (``docs/pipeline.md``).

Backends (chosen to match the server's ``--weight-transfer-config``):

* ``toolgym_shm`` (:class:`SharedMemorySender`, CPU): each chunk is a safetensors file in shared
  memory; only its path and the tensor metadata travel in the JSON body. The server side is
  :mod:`trainer.sync.vllm_plugin`.
* ``nccl`` (:class:`NCCLSender`, GPU): vLLM's own trainer-side engine
  (``NCCLTrainerWeightTransferEngine``) broadcasting from trainer rank 0 to the server's workers
  (``rank_offset=1``), with :class:`VLLMAdminClient` as its control-plane client, so the HTTP call
  carries the timeout and a failure raises instead of hanging.

Every tensor is checked against the served checkpoint's names and shapes *before*
``/start_weight_update``: a failure after that point leaves the server half-updated, so it is
raised as a :class:`~trainer.exceptions.WeightSyncError` and treated as fatal.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.exceptions import WeightSyncError
from trainer.sync.vllm_plugin import PROTOCOL_VERSION
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
    """A backend that moves tensors into the server between start and finish."""

    supports_whole_update: bool  # can load a whole update in one engine call (no pause needed)

    def init(self) -> None:
        """One-time handshake with the server."""

    def transfer(self, weights: TensorSource, version: int, whole_update: bool = False,
                 read_done: Callable[[], None] | None = None) -> None:
        """Run start -> update(s) -> finish(version) for ``weights``; with ``whole_update``, one
        update call loads everything (only where ``supports_whole_update``). ``read_done`` is called
        once ``weights`` are no longer read (the caller may change them from then on)."""


def _chunks(weights: TensorSource, max_bytes: int) -> Iterator[NamedTensors]:
    chunk: NamedTensors = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


def _shared_memory_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class SharedMemorySender:
    """``toolgym_shm`` backend: safetensors files in shared memory, metadata over HTTP.

    Args:
        client: The server's admin client.
        chunk_bytes: Largest chunk written at once (bounds the shared memory in use).
    """

    supports_whole_update = True

    def __init__(self, client: VLLMAdminClient, chunk_bytes: int = 512 << 20) -> None:
        self.client = client
        self.chunk_bytes = chunk_bytes

    def init(self) -> None:
        """Handshake: tells the server's engine which wire protocol we speak."""
        self.client.init_weight_transfer_engine({"protocol_version": PROTOCOL_VERSION})

    def transfer(self, weights: TensorSource, version: int, whole_update: bool = False,
                 read_done: Callable[[], None] | None = None) -> None:
        """Write each chunk to shared memory and have the server load it (chunk by chunk, or, with
        ``whole_update``, every chunk written first, ``read_done`` called, and all loaded by one call),
        then finish.

        One chunk at a time bounds the shared memory in use by ``chunk_bytes``; a whole update
        holds the whole policy there until the server has loaded it.
        """
        with tempfile.TemporaryDirectory(prefix="toolgym-weights-", dir=_shared_memory_dir()) as tmp:
            chunks = (self._write(tmp, i, chunk) for i, chunk in enumerate(_chunks(weights, self.chunk_bytes)))
            if whole_update:
                first, *rest = list(chunks) or [self._write(tmp, 0, [])]
                if read_done is not None:
                    read_done()
                self.client.start_weight_update()
                self.client.update_weights({**first, "more_chunks": rest, "whole_update": True})
            else:
                self.client.start_weight_update()
                for info in chunks:
                    self.client.update_weights(info)
                    os.unlink(info["path"])
                if read_done is not None:
                    read_done()
        self.client.finish_weight_update(str(version))

    @staticmethod
    def _write(tmp: str, index: int, chunk: NamedTensors) -> dict[str, Any]:
        """Save ``chunk`` as a safetensors file in ``tmp``; the update info that describes it."""
        from safetensors.torch import save_file

        path = os.path.join(tmp, f"chunk{index}.safetensors")
        save_file({n: t.detach().contiguous().cpu() for n, t in chunk}, path)
        return {"path": path, "names": [n for n, _ in chunk],
                "dtype_names": [str(t.dtype).split(".")[-1] for _, t in chunk],
                "shapes": [list(t.shape) for _, t in chunk]}


class _StaticSource:
    """A re-iterable (name, tensor) source in the shape vLLM's trainer engines expect."""

    def __init__(self, weights: TensorSource) -> None:
        self.weights = weights

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        meta = getattr(self.weights, "meta", None)  # streamed: described without gathering
        listed: TensorSource = meta() if meta is not None else self.weights
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in listed]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.weights)


class NCCLSender:
    """``nccl`` backend through vLLM's ``NCCLTrainerWeightTransferEngine`` (GPU servers).

    The trainer's rank 0 is NCCL rank 0; the server's workers join at ``rank_offset=1``.
    This path needs CUDA on both sides, so it is not exercised by the CPU test-suite.

    Args:
        client: The server's admin client (carries the HTTP timeout).
        master_address: Address of the rendezvous store that this trainer opens.
        master_port: Its port.
        server_world_size: Number of the server's workers (``/get_world_size``).
    """

    supports_whole_update = False  # vLLM's NCCL engine drives start / update / finish itself

    def __init__(self, client: VLLMAdminClient, master_address: str, master_port: int, server_world_size: int) -> None:
        self.client = client
        self.master_address = master_address
        self.master_port = master_port
        self.server_world_size = server_world_size
        self._source = _StaticSource([])
        self._engine: Any = None

    def init(self) -> None:
        """Rendezvous with the server's workers and open the NCCL group."""
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        info = NCCLTrainerInitInfo(
            master_address=self.master_address, master_port=self.master_port,
            world_size=self.server_world_size + 1, rank=0,
        )
        # _StaticSource quacks like vllm's WeightSource; subclassing it would import vllm with this module.
        self._engine = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=self.client, source=self._source)  # type: ignore[arg-type]

    def transfer(self, weights: TensorSource, version: int, whole_update: bool = False,
                 read_done: Callable[[], None] | None = None) -> None:
        """Broadcast ``weights`` (start/update/finish are driven by vLLM's engine)."""
        if whole_update:
            raise WeightSyncError("the nccl backend cannot load a whole update in one call")
        self._source.weights = weights
        self._engine.send_weights()
        if read_done is not None:
            read_done()
        self.client.request("POST", "/update_weight_version", {"new_version": str(version)}, error=WeightSyncError)


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
            ``"reset"`` (the source's pause: the KV cache is cleared, preempting every running
            request).
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
