"""``nccl``: vLLM's own trainer-side engine (``NCCLTrainerWeightTransferEngine``) broadcasting from
the trainer's rank 0 to the server's workers (``rank_offset=1``), with :class:`VLLMAdminClient` as
its control-plane client, so the HTTP call carries the timeout and a failure raises instead of
hanging. For GPU servers; it needs CUDA on both sides, so the CPU test-suite does not run it.

The rendezvous store this trainer opens listens on ``TOOLGYM_WEIGHT_SYNC_HOST`` (default
``127.0.0.1``) and ``TOOLGYM_WEIGHT_SYNC_PORT`` (default 51216). With several servers each has its
own NCCL group (one transfer group per server: vLLM's engine broadcasts to one server's workers),
rendezvousing on that port + the sender's index; a server that comes back gets a new group on a new
port (not run here: no GPU build of vLLM on these machines).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer.exceptions import WeightSyncError
from trainer.sync.weight_sync import TensorSource
from trainer.vllm.admin import VLLMAdminClient


def make_sender(admin: VLLMAdminClient, index: int = 0) -> NCCLSender:
    """This backend's sender for the server at ``admin``: as many NCCL peers as the server has workers,
    rendezvousing on ``TOOLGYM_WEIGHT_SYNC_PORT`` + ``index``."""
    world = admin.request("GET", "/get_world_size")
    size = int(world.get("world_size", 1)) if isinstance(world, dict) else int(world)
    port = int(os.environ.get("TOOLGYM_WEIGHT_SYNC_PORT", "51216")) + index
    return NCCLSender(admin, os.environ.get("TOOLGYM_WEIGHT_SYNC_HOST", "127.0.0.1"), port, size)


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
