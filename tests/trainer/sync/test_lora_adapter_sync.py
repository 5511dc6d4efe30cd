"""LoRA, adapter-only sync: a server started with ``--enable-lora`` serves each policy version as an
adapter (real vLLM CPU server, one for this module)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.trainer.spread_reward import token_reward
from tests.trainer.sync.test_lora_sync import _logprobs, _sample
from tests.trainer.training.torchrun import torchrun_two_ranks
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import ConfigError, WeightSyncError
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.records import adapter_name
from trainer.sync.lora_sync import LORA_CACHE_DIR, LoRAAdapterSync, runtime_lora_limits
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.prometheus import parse_prometheus
from trainer.vllm.server_info import LoRALimits, read_server_info

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
MAX_LORAS = 3  # fits max_staleness=1 (1 + 2)


pytestmark = pytest.mark.vllm  # every test here uses a LoRA-enabled vLLM server of its own

@pytest.fixture(scope="module")
def lora_server(tiny_model_dir: Path) -> Iterator[VLLMServer]:
    """A vLLM CPU server on the tiny model with runtime LoRA loading (--max-loras 3, --max-lora-rank 8)."""
    config = VLLMServerConfig(model=str(tiny_model_dir), max_model_len=1024, enable_lora=True,
                              max_loras=MAX_LORAS, max_lora_rank=8)
    with VLLMServer(config) as server:
        yield server


def _peft_model(model_dir: Path, r: int = 4, seed: int = 0) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS))
    _randomise_adapter(model, seed)
    return model


def _randomise_adapter(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():  # lora_B starts at zero: give the adapter an effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)


def _merged_logprobs(model: PeftModel, output: list[int]) -> torch.Tensor:
    return _logprobs(copy.deepcopy(model).merge_and_unload(), output)


def _served_names(admin: VLLMAdminClient) -> set[str]:
    return {m["id"] for m in admin.request("GET", "/v1/models")["data"]}


def test_the_server_reports_its_lora_limits(lora_server: VLLMServer, vllm_server: VLLMServer) -> None:
    limits = runtime_lora_limits(read_server_info(VLLMAdminClient(lora_server.base_url, timeout_s=30)))
    assert limits == LoRALimits(max_loras=MAX_LORAS, max_lora_rank=8, runtime_loading=True)
    assert runtime_lora_limits(read_server_info(VLLMAdminClient(vllm_server.base_url, timeout_s=30))) is None, \
        "a server without --enable-lora gets the merged sync"


def test_versions_are_served_by_name_and_old_ones_retired(
    lora_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    admin = VLLMAdminClient(lora_server.base_url, timeout_s=60)
    model = _peft_model(tiny_model_dir)
    sync = LoRAAdapterSync(admin, tmp_path / LORA_CACHE_DIR, "policy", keep=2)
    try:
        for version in range(3):
            if version:
                _randomise_adapter(model, seed=version)  # a "trained" adapter per version
            sync.load(model, version)
            assert adapter_name("policy", version) in _served_names(admin), "loaded before the oldest goes"
            sync.retire()
            # The served adapter's log-probs are the merged model's.
            output, served = _sample(lora_server.base_url, adapter_name("policy", version))
            torch.testing.assert_close(torch.tensor(served), _merged_logprobs(model, output), atol=1e-4, rtol=0)
        names = _served_names(admin)
        assert {"policy-v1", "policy-v2"} <= names and "policy-v0" not in names
        assert not sync.folder(0).exists() and sync.folder(1).is_dir() and sync.folder(2).is_dir()
        # The adapter changes what the server samples from: the base model's log-probs differ.
        output, served = _sample(lora_server.base_url, adapter_name("policy", 2))
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        assert (torch.tensor(served) - _logprobs(base, output)).abs().max() > 1e-2
    finally:
        sync.close()
    assert not _served_names(admin) & {"policy-v1", "policy-v2"}
    assert not (tmp_path / LORA_CACHE_DIR).exists()


def test_a_refused_load_raises_with_the_servers_message(
    lora_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    admin = VLLMAdminClient(lora_server.base_url, timeout_s=60)
    sync = LoRAAdapterSync(admin, tmp_path / LORA_CACHE_DIR, "too-big", keep=2)
    with pytest.raises(WeightSyncError, match="load_lora_adapter") as info:
        sync.load(_peft_model(tiny_model_dir, r=16), 0)  # the server serves rank <= 8
    assert "16" in info.value.detail, info.value.detail
    assert not sync.folder(0).exists() and not sync.loaded


def _trainer(model_dir: Path, server: VLLMServer, out: Path, r: int = 4, **overrides: Any) -> AsyncGRPOTrainer:
    kwargs: dict[str, Any] = dict(
        output_dir=str(out), vllm_server_base_url=server.base_url, max_steps=3, num_generations=4,
        max_completion_length=16, learning_rate=1e-3, report_to="none", use_cpu=True, max_staleness=1,
        gradient_checkpointing=False, save_strategy="no", logging_steps=1, rollout_worker_timeout=60,
        vllm_server_timeout=60, disable_tqdm=True,
    )
    kwargs.update(overrides)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(12)]})
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS)
    return AsyncGRPOTrainer(model=str(model_dir), reward_funcs=token_reward, args=AsyncGRPOConfig(**kwargs),
                            train_dataset=dataset, peft_config=lora)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"max_staleness": 2}, r"--max-loras is 3 .* restart the server with --max-loras 4"),
    ({"r": 16}, r"--max-lora-rank is 8 but the adapter's rank is 16: restart the server with --max-lora-rank 16"),
])
def test_limits_too_small_are_refused_at_start(
    lora_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    trainer = _trainer(tiny_model_dir, lora_server, tmp_path / "out", **overrides)
    with pytest.raises(ConfigError, match=message):
        trainer.train()
    assert trainer.worker is None


def test_short_run_syncs_adapters(lora_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    log_start = len(lora_server.log_path.read_text(errors="replace"))
    trainer = _trainer(tiny_model_dir, lora_server, tmp_path / "out")
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()

    assert trainer.state.global_step == 3 and trainer.stream.policy_version == 3
    trained = [n for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert any(not torch.equal(trainer.model.get_parameter(n).detach(), initial[n]) for n in trained), "it trained"
    seen = set().union(*(h.keys() for h in trainer.state.log_history))
    assert {"perf/weight_sync_s", "perf/weight_sync_transfer_s", "perf/weight_sync_pause_s", "reward"} <= seen
    # Versions 0..3 were loaded in order, each retiring the one max_staleness + 1 = 2 versions back,
    # and shutdown unloaded the rest and removed the cache folder.
    log = lora_server.log_path.read_text(errors="replace")[log_start:]
    events = re.findall(r"(Loaded new|Removed) LoRA adapter: name '(toolgym-\w+)-v(\d)'", log)
    run = {name for _, name, _ in events}
    assert len(run) == 1, events
    order = [("load" if kind == "Loaded new" else "unload", int(v)) for kind, _, v in events]
    assert order[:6] == [("load", 0), ("load", 1), ("load", 2), ("unload", 0), ("load", 3), ("unload", 1)], order
    assert sorted(order[6:]) == [("unload", 2), ("unload", 3)], order
    assert not (tmp_path / "out" / LORA_CACHE_DIR).exists()
    # Rollouts asked for the adapters by name: the server ran requests under them.
    samples = parse_prometheus(VLLMAdminClient(lora_server.base_url).request("GET", "/metrics"))
    running = {a for n, labels, _ in samples if n == "vllm:lora_requests_info"
               for a in labels.get("running_lora_adapters", "").split(",") if a}
    prefix = next(iter(run))
    assert any(a.startswith(prefix) for a in running), running


@pytest.mark.timeout(1500)
def test_sharded_run_syncs_full_adapters(lora_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    """FSDP2 on 2 CPU ranks (``fsdp_lora_run.py``), adapter-only sync: every rank joins the gather of
    the adapter's shards, rank 0 writes each version in full and the server loads it; the last
    version written is the trained adapter both ranks hold."""
    log_start = len(lora_server.log_path.read_text(errors="replace"))
    returncode, stderr = torchrun_two_ranks("fsdp_lora_run.py", str(tiny_model_dir), lora_server.base_url,
                                            str(tmp_path))
    assert returncode == 0, stderr[-5000:]
    records = [json.loads((tmp_path / f"lora{r}.json").read_text()) for r in range(2)]
    assert all(r["dtensor"] and r["global_step"] == 2 and r["policy_version"] == 2 for r in records), records
    assert json.loads((tmp_path / "loads.json").read_text()) == [0, 1, 2]
    ranks = [torch.load(tmp_path / f"lora{r}.pt") for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys() and all(torch.equal(p, ranks[1][n]) for n, p in ranks[0].items())
    written = load_file(tmp_path / "adapter_v2.safetensors")
    # PEFT writes the adapter without its name: lora_A.default.weight -> lora_A.weight.
    assert written.keys() == {n.replace(".default", "") for n in ranks[0]}
    for name, p in ranks[0].items():
        assert torch.equal(written[name.replace(".default", "")], p), name  # in full, not a shard
    initial = load_file(tmp_path / "adapter_v0.safetensors")  # the untrained adapter: lora_B is zero
    assert all(not t.any() for n, t in initial.items() if "lora_B" in n)
    assert any(t.any() for n, t in written.items() if "lora_B" in n), "the adapter did not train"
    log = lora_server.log_path.read_text(errors="replace")[log_start:]
    loaded = re.findall(r"Loaded new LoRA adapter: name '(toolgym-\w+)-v(\d)'", log)
    assert [int(v) for _, v in loaded] == [0, 1, 2] and len({n for n, _ in loaded}) == 1, loaded
