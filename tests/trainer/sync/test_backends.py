"""The weight-transfer backend table: the trainer takes its side of the backend the server reports, the
launcher starts servers with names from the same table, and a name outside it is refused naming the table."""

from __future__ import annotations

import json
import logging

import pytest

from trainer.exceptions import ConfigError
from trainer.launch.vllm_server import VLLMServerConfig, is_cpu_build
from trainer.sync.backends import BACKENDS, default_backend, make_sender
from trainer.sync.backends.shared_memory import SharedMemorySender
from trainer.sync.lora_sync import runtime_lora_limits
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.server_info import LoRALimits, ServerInfo


def test_each_platform_has_a_default_from_the_table() -> None:
    assert default_backend("cpu") == "toolgym_shm" and default_backend("cuda") == "nccl"
    assert {default_backend("cpu"), default_backend("cuda")} <= BACKENDS.keys()


def test_the_launcher_serves_the_table_default_of_its_build_or_the_name_given() -> None:
    def backend(config: VLLMServerConfig) -> str:
        command = config.command(8000)
        return str(json.loads(command[command.index("--weight-transfer-config") + 1])["backend"])

    assert backend(VLLMServerConfig(model="m")) == default_backend("cpu" if is_cpu_build() else "cuda")
    assert backend(VLLMServerConfig(model="m", weight_transfer_backend="nccl")) == "nccl"
    with pytest.raises(ConfigError, match="weight_transfer_backend='ipc' is not a backend the trainer can drive: "
                                          "give one of toolgym_shm, nccl"):
        VLLMServerConfig(model="m", weight_transfer_backend="ipc")


def test_the_sender_is_the_one_of_the_backend_the_server_runs() -> None:
    admin = VLLMAdminClient("http://127.0.0.1:9")
    assert isinstance(make_sender("toolgym_shm", admin), SharedMemorySender)
    with pytest.raises(ConfigError, match="runs the weight-transfer backend 'ipc', which the trainer cannot drive"):
        make_sender("ipc", admin)
    with pytest.raises(ConfigError, match="reports no weight-transfer backend.*VLLM_SERVER_DEV_MODE=1"):
        make_sender(None, admin)


def test_adapters_are_synced_only_where_the_server_loads_them_at_run_time(caplog: pytest.LogCaptureFixture) -> None:
    def server(lora: LoRALimits | None) -> ServerInfo:
        return ServerInfo(model="m", max_model_len=64, lora=lora)

    assert runtime_lora_limits(server(None)) is None
    loads = LoRALimits(max_loras=3, max_lora_rank=8, runtime_loading=True)
    assert runtime_lora_limits(server(loads)) == loads
    with caplog.at_level(logging.WARNING):
        assert runtime_lora_limits(server(LoRALimits(3, 8, runtime_loading=False))) is None
    assert "without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in caplog.text
