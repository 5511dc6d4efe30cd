"""A weight sync in one call, outside the trainer: "push these weights to the server at URL as version N".

For scripts, tests and benchmarks that set the served policy themselves (the trainer keeps one
synchroniser for a whole run instead, :mod:`trainer.sync.policy_sync`)::

    from trainer.sync import push_weights

    push_weights("http://127.0.0.1:8000", model.named_parameters(), version=3, model_dir="path/to/model")
"""

from __future__ import annotations

import os

from trainer.sync.backends import make_sender
from trainer.sync.weight_sync import SyncTimings, TensorSource, WeightSynchronizer, checkpoint_manifest
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.server_info import read_server_info


def weight_synchronizer(base_url: str, model_dir: str | os.PathLike[str] | None = None, *,
                        pause_mode: str = "none", timeout_s: float = 120.0) -> WeightSynchronizer:
    """A synchroniser for the vLLM server at ``base_url``, through the weight-transfer backend it runs.

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000``.
        model_dir: The served checkpoint: every sync is checked against its names and shapes
            before anything reaches the server; ``None``: not checked.
        pause_mode: ``weight_sync_pause`` (:class:`~trainer.sync.weight_sync.WeightSynchronizer`).
        timeout_s: Timeout of each call to the server, in seconds.
    """
    admin = VLLMAdminClient(base_url, timeout_s=timeout_s)
    backend = read_server_info(admin).weight_transfer_backend
    manifest = checkpoint_manifest(model_dir) if model_dir is not None else {}
    return WeightSynchronizer(admin, make_sender(backend, admin), manifest, pause_mode=pause_mode)


def push_weights(base_url: str, weights: TensorSource, version: int,
                 model_dir: str | os.PathLike[str] | None = None, *, timeout_s: float = 120.0) -> SyncTimings:
    """Push ``weights`` (``(name, tensor)`` pairs, by checkpoint name) into the vLLM server at
    ``base_url`` as policy ``version``; the server reports that version afterwards.

    Arguments as :func:`weight_synchronizer`. Raises :class:`~trainer.exceptions.WeightSyncError`
    when the weights do not match ``model_dir`` or the server refuses them.
    """
    return weight_synchronizer(base_url, model_dir, timeout_s=timeout_s).sync(weights, version)
