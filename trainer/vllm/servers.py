"""Several vLLM servers named in one ``vllm_server_base_url``: the URLs (:func:`trainer.config.server_urls`) and
what they serve, read once from each and checked to agree (:func:`read_servers_info`).

``vllm_server_base_url`` is one URL, several joined by commas (the command line), or a list
(Python, YAML). Every server must serve the same model with the same ``max_model_len``: a rollout's
turns are sampled on one server, but any server may take any rollout, and the turn limit and the
request's ``"model"`` are set once for all of them. The rollout worker routes rollouts over them
(:mod:`trainer.rollout.servers`); every weight sync reaches each (:mod:`trainer.sync.fleet_sync`).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.exceptions import ConfigError
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.server_info import ServerInfo, read_server_info

__all__ = ["read_servers", "read_servers_info"]


def read_servers_info(admins: Sequence[VLLMAdminClient], wait_s: float | None = None) -> list[ServerInfo]:
    """:func:`~trainer.vllm.server_info.read_server_info` of each server, in order, once they agree.

    Raises:
        VLLMServerError: A server did not answer within ``wait_s`` (its URL is named).
        ConfigError: The servers serve different models or ``max_model_len``s; each server's value is named.
    """
    infos = [read_server_info(admin, wait_s) for admin in admins]
    for name in ("model", "max_model_len"):
        values = [getattr(info, name) for info in infos]
        if len(set(values)) > 1:
            each = ", ".join(f"{admin.base_url}: {v!r}" for admin, v in zip(admins, values, strict=True))
            raise ConfigError(f"the vLLM servers disagree on {name} ({each}): every server must serve the same "
                              f"model with the same --max-model-len; restart the odd ones out to match")
    return infos


def read_servers(urls: Sequence[str], timeout_s: float) -> list[ServerInfo]:
    """:func:`read_servers_info` of the servers at ``urls``, each call bounded by ``timeout_s``."""
    return read_servers_info([VLLMAdminClient(url, timeout_s=timeout_s) for url in urls])
