"""Adapter-only LoRA sync: the server serves each policy version as a LoRA adapter of its own.

Chosen at trainer start when the model is a PEFT LoRA model and the server runs ``--enable-lora``
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (:attr:`ServerInfo.lora
<trainer.vllm.server_info.ServerInfo.lora>`, read once at start from the dev-mode ``/server_info``
route, like the ``/pause`` and weight-transfer routes every sync uses); otherwise the trainer merges the adapter
into the base weights and sends those (:func:`trainer.sync.weight_sync.merged_lora_weights`). One sync::

    save_pretrained  -> <output_dir>/.vllm_lora/<lora_name>-v<version>/
    POST /v1/load_lora_adapter {"lora_name": "<lora_name>-v<version>", "lora_path": ...}
    (the trainer publishes the new version: new rollouts ask for that name)
    POST /v1/unload_lora_adapter  for every version beyond the newest max_staleness + 1, and rm -r its folder

Generation is not paused: a running request keeps the adapter it started with, a new adapter name
never shares prefix-cache blocks with an old one, and a rollout requests the adapter of the version
it started under (:func:`adapter_name`), so it finishes under that policy. vLLM reads adapters from
disk, so ``output_dir`` must be visible to the server. The folder is a serving cache: checkpoints
keep the trained adapter.

vLLM 0.32 facts this relies on: ``/server_info?config_format=json`` carries ``vllm_config.lora_config``
(``max_loras``, ``max_lora_rank``; ``null`` without ``--enable-lora``) and ``vllm_env``; a failed load
answers 4xx/5xx with the reason (e.g. 404 "No adapter found"); unloading only unregisters the name
(the engine's adapter cache is an LRU of ``max_loras`` entries, so in-flight requests keep theirs).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from trainer.exceptions import ConfigError, VLLMServerError, WeightSyncError
from trainer.records import adapter_name
from trainer.sync.weight_sync import SyncTimings
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.server_info import LoRALimits, ServerInfo

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

LORA_CACHE_DIR = ".vllm_lora"
logger = logging.getLogger(__name__)


def runtime_lora_limits(server: ServerInfo) -> LoRALimits | None:
    """The server's LoRA limits when it can load adapters at run time, ``None`` when it cannot (then
    the merged sync is used).

    It can when it was started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``. A
    server outside dev mode (no ``/server_info``) cannot be told apart from one without them.
    """
    if server.lora is not None and not server.lora.runtime_loading:
        logger.warning("LoRA: the server runs --enable-lora without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, so "
                       "adapters cannot be loaded at run time; using the merged-weight sync")
        return None
    return server.lora


def adapter_rank(model: PeftModel) -> int:
    """The largest LoRA rank of the PEFT model's active adapters (``r`` and any ``rank_pattern``)."""
    ranks = [1]
    for name in _active_adapters(model):
        config = cast("LoraConfig", model.peft_config[name])  # a LoRA adapter (see adapter_sync_obstacle)
        ranks.append(int(config.r))
        ranks += [int(r) for r in (getattr(config, "rank_pattern", None) or {}).values()]
    return max(ranks)


def _active_adapters(model: PeftModel) -> list[str]:
    active = model.active_adapter
    return list(active) if isinstance(active, (list, tuple)) else [active]


def adapter_sync_obstacle(model: PeftModel) -> str | None:
    """Why this PEFT model cannot be served as an adapter (then the merged sync is used), or ``None``."""
    configs = [model.peft_config[name] for name in _active_adapters(model)]
    if len(configs) != 1:
        return f"{len(configs)} active adapters (vLLM serves one per request)"
    config = configs[0]
    if str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        return f"a {config.peft_type} adapter (vLLM serves LoRA only)"
    if getattr(config, "use_dora", False):
        return "a DoRA adapter"
    if modules := getattr(config, "modules_to_save", None):
        return f"modules_to_save={modules} (fully trained modules are not part of an adapter)"
    return None


def check_lora_limits(server: LoRALimits, max_staleness: int, rank: int) -> None:
    """Raise :class:`ConfigError` naming the flag to restart the server with when the limits do not fit.

    ``max_staleness + 1`` versions stay registered and the next one is loaded before the oldest
    goes, so ``--max-loras`` must be at least ``max_staleness + 2``; ``--max-lora-rank`` must be at
    least the adapter's rank (it is the largest rank served, not the rank served).
    """
    problems = []
    if server.max_loras < max_staleness + 2:
        problems.append(
            f"--max-loras is {server.max_loras} but max_staleness={max_staleness} keeps {max_staleness + 1} adapter "
            f"versions registered and loads the next before the oldest goes: restart the server with "
            f"--max-loras {max_staleness + 2} (or lower max_staleness)")
    if server.max_lora_rank < rank:
        allowed = [r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank]
        fix = f"--max-lora-rank {allowed[0]}" if allowed else "a smaller LoRA rank"
        problems.append(f"--max-lora-rank is {server.max_lora_rank} but the adapter's rank is {rank}: "
                        f"restart the server with {fix}")
    if problems:
        raise ConfigError("the vLLM server runs --enable-lora (adapter-only sync) but " + "; ".join(problems))


class LoRAAdapterSync:
    """Saves, registers and retires adapter versions on the server, or on each of several.

    A version is written once and registered on every server that takes the sync
    (:meth:`write`, then :meth:`register` per server; :meth:`load` does both on every server). A
    server that comes back after it was lost has none of them: :meth:`forget` it, then register the
    current version.

    Args:
        client: The server's admin client (its timeout bounds every call), or one per server.
        cache_dir: Where versions are written (``<output_dir>/.vllm_lora``); must be readable by the server.
        lora_name: Prefix of the served names (:func:`adapter_name`); unique per run, so that a
            server shared between runs never sees the same name twice.
        keep: Versions kept registered (``max_staleness + 1``).
    """

    def __init__(self, client: VLLMAdminClient | list[VLLMAdminClient], cache_dir: str | Path, lora_name: str,
                 keep: int) -> None:
        self.clients = list(client) if isinstance(client, list) else [client]
        self.client = self.clients[0]
        self.cache_dir = Path(cache_dir)
        self.lora_name = lora_name
        self.keep = keep
        self.loaded: deque[int] = deque()  # versions written and not yet retired, oldest first
        self.registered: list[set[int]] = [set() for _ in self.clients]  # per server
        self._paths: dict[int, Path] = {}  # version -> the folder the servers read it from

    def folder(self, version: int) -> Path:
        """Where ``version`` is written."""
        return self.cache_dir / adapter_name(self.lora_name, version)

    def load(self, model: PeftModel, version: int, state_dict: dict[str, Any] | None = None) -> SyncTimings:
        """Write the PEFT model's adapter as ``version`` and register it on every server; raises
        :class:`WeightSyncError` with the server's message when a server refuses it (the version's
        folder is then removed).

        ``state_dict``: the adapter's tensors gathered from FSDP2 shards
        (:func:`trainer.sync.gather.adapter_state_dict`); ``None`` reads them from the model."""
        t0 = time.perf_counter()
        self.write(model, version, state_dict)
        try:
            for i in range(len(self.clients)):
                self.register(i, version)
        except WeightSyncError:
            self.loaded.remove(version)
            shutil.rmtree(self.folder(version), ignore_errors=True)
            raise
        return SyncTimings(pause_s=0.0, transfer_s=time.perf_counter() - t0, resume_s=0.0)

    def write(self, model: PeftModel, version: int, state_dict: dict[str, Any] | None = None) -> None:
        """Save the PEFT model's active adapter as ``version`` (registered nowhere yet)."""
        folder = self.folder(version)
        if folder.exists():  # a previous attempt at this version
            shutil.rmtree(folder)
        active = _active_adapters(model)[0]
        model.save_pretrained(str(folder), selected_adapters=[active], state_dict=state_dict)
        self._paths[version] = folder if active == "default" else folder / active  # PEFT's layout for other names
        if version not in self.loaded:
            self.loaded.append(version)

    def register(self, i: int, version: int) -> None:
        """Register the written ``version`` on server ``i``; :class:`WeightSyncError` when it refuses."""
        path = self._paths[version]
        body = {"lora_name": adapter_name(self.lora_name, version), "lora_path": str(path.resolve())}
        self.clients[i].request("POST", "/v1/load_lora_adapter", body, error=WeightSyncError)
        self.registered[i].add(version)

    def forget(self, i: int) -> None:
        """Server ``i`` holds no adapter any more (it was restarted)."""
        self.registered[i].clear()

    def retire(self) -> float:
        """Unload every version beyond the newest ``keep`` and delete its folder; returns the seconds spent.
        With several servers, a server that cannot be reached is skipped (it was lost)."""
        t0 = time.perf_counter()
        while len(self.loaded) > self.keep:
            version = self.loaded.popleft()
            for i in range(len(self.clients)):
                if version in self.registered[i]:
                    try:
                        self._unload(i, version)
                    except VLLMServerError as exc:
                        if len(self.clients) == 1:
                            raise
                        logger.warning("LoRA: could not unload %s from %s: %s", adapter_name(self.lora_name, version),
                                       self.clients[i].base_url, exc)
            shutil.rmtree(self.folder(version), ignore_errors=True)
            self._paths.pop(version, None)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Unload every registered version and delete the cache folder (best effort: the run is over)."""
        for i in range(len(self.clients)):
            for version in sorted(self.registered[i]):
                try:
                    self._unload(i, version)
                except VLLMServerError as exc:
                    logger.warning("LoRA: could not unload an adapter at shutdown: %s", exc)
        self.loaded.clear()
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    def _unload(self, i: int, version: int) -> None:
        body = {"lora_name": adapter_name(self.lora_name, version)}
        self.registered[i].discard(version)
        self.clients[i].request("POST", "/v1/unload_lora_adapter", body, error=WeightSyncError)
