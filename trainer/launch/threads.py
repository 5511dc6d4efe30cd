"""The torch thread policy of CPU runs, in one place.

A vLLM CPU server keeps its cores busy; a trainer with as many torch threads as cores fights it
(measured on 2 cores: a 900-token forward/backward of the tiny model took 25 s on two threads,
0.7 s on one). So a CPU trainer beside a local vLLM CPU server trains on half the cores.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from trainer.launch.vllm_server import is_cpu_build

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def trainer_threads_beside_vllm(cpu_count: int) -> int:
    """Torch threads for a CPU trainer beside a vLLM CPU server on the same machine: half the cores."""
    return max(1, cpu_count // 2)


def share_cores_with_local_vllm(vllm_base_url: str, device_type: str) -> int | None:
    """Set the torch threads for a CPU trainer whose vLLM CPU server runs on this machine.

    Args:
        vllm_base_url: The server the trainer samples from.
        device_type: The trainer's device (``"cpu"``, ``"cuda"``...).

    Returns:
        The threads set, or ``None`` when the policy does not apply (GPU, remote or GPU server).
    """
    host = urllib.parse.urlsplit(vllm_base_url).hostname
    if device_type != "cpu" or not is_cpu_build() or host not in LOOPBACK:
        return None
    threads = trainer_threads_beside_vllm(os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads, then restore the previous setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
