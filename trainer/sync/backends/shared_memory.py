"""``toolgym_shm``: each chunk of tensors is a safetensors file in shared memory; only its path and
the tensor metadata travel in the JSON body. For CPU servers (vLLM's own backends need CUDA); the
server side is :mod:`trainer.sync.vllm_plugin`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from trainer.sync.vllm_plugin import PROTOCOL_VERSION
from trainer.sync.weight_sync import NamedTensors, TensorSource
from trainer.vllm.admin import VLLMAdminClient


def make_sender(admin: VLLMAdminClient, index: int = 0) -> SharedMemorySender:
    """This backend's sender for the server at ``admin`` (:mod:`trainer.sync.backends`; every sender
    writes files of its own, so ``index`` changes nothing)."""
    return SharedMemorySender(admin)


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
