"""Sharded training (FSDP2, ``trainer/training/fsdp.py``, ``trainer/sync/gather.py``).

The refusals at construction, and one real 2-rank ``torchrun`` launch on CPU (gloo; FSDP2's
``fully_shard`` runs there) against the real vLLM CPU server, whose outputs several tests read:
the run trains, every rank's gathered parameters are identical, the weight sync sends full tensors
equal to the gathered model, a resumed run restores the sharded model and the prompt position, and
a LoRA run syncs merged weights (``tests/trainer/training/fsdp_run.py`` is the launched script).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.training.torchrun import torchrun_two_ranks
from trainer import AsyncGRPOConfig
from trainer.exceptions import ConfigError
from trainer.launch.vllm_server import VLLMServer
from trainer.sync.weight_sync import checkpoint_manifest


@pytest.mark.parametrize("kwargs, message", [
    ({"deepspeed": {"zero_optimization": {"stage": 3}}}, "DeepSpeed is not supported"),
    ({"fsdp": "full_shard", "fsdp_config": {"version": 1}}, "only FSDP2 is supported"),
    ({"fsdp": "hybrid_shard"}, "exist only for FSDP1"),
])
def test_unsupported_parallelism_is_refused(kwargs: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)


@pytest.mark.parametrize("field", ["cp_size", "sp_size", "tp_size"])
def test_context_sequence_tensor_parallelism_are_refused(field: str, tmp_path: Path) -> None:
    from accelerate.parallelism_config import ParallelismConfig

    config = ParallelismConfig.__new__(ParallelismConfig)  # no device mesh needed: only the sizes are read
    for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
        setattr(config, name, 1)
    setattr(config, field, 2)
    with pytest.raises(ConfigError, match=f"parallelism_config.{field}=2"):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, parallelism_config=config)


def test_accelerate_config_asking_for_fsdp1_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True)


def test_fsdp2_gets_an_explicit_version(tmp_path: Path) -> None:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, fsdp="full_shard")
    assert args.fsdp_plugin_args["fsdp_version"] == 2


FSDP2_ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
use_cpu: true
mixed_precision: "no"
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""


@pytest.mark.slow  # two processes under accelerate launch: about 20 s
@pytest.mark.timeout(600)
def test_accelerate_launch_with_an_fsdp2_config_file_shards_on_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The accelerate config file route (no ``fsdp`` field in the trainer's config): accelerate makes
    a CPU run MULTI_CPU and leaves it unsharded; the trainer installs the file's FSDP2 plugin."""
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP2_ACCELERATE_CONFIG)
    returncode, stderr = torchrun_two_ranks("accelerate_fsdp_probe.py", str(tiny_model_dir), str(tmp_path),
                                            timeout_s=300, accelerate_config=config)
    assert returncode == 0, stderr[-5000:]
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"fsdp": True, "sharded": True}


# ------------------------------------------------------------------------------ the real run
@pytest.fixture(scope="module")
def fsdp_run(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank launch of ``fsdp_run.py``; its output directory. The served weights are put back after."""
    from trainer.sync import push_weights

    out = tmp_path_factory.mktemp("fsdp")
    try:
        returncode, stderr = torchrun_two_ranks("fsdp_run.py", str(tiny_model_dir), vllm_server.base_url, str(out))
    finally:  # put the served weights back for the session's other tests
        from transformers import AutoModelForCausalLM

        weights = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters()
        push_weights(vllm_server.base_url, weights, 0, tiny_model_dir)
    assert returncode == 0, stderr[-5000:]
    return out


def _load(out: Path, name: str) -> list[Any]:
    return [torch.load(out / f"{name}{r}.pt") for r in range(2)]


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_sharded_run_trains_and_ranks_agree(fsdp_run: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    records = [json.loads((fsdp_run / f"full{r}.json").read_text()) for r in range(2)]
    for rec in records:
        assert rec["fsdp"] and rec["dtensor"], "the parameters were not sharded"
        assert rec["global_step"] == 2 and rec["policy_version"] == 2
    params = _load(fsdp_run, "full")
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())
    assert params[0].keys() == initial.keys()
    for name, p in params[0].items():
        assert p.shape == initial[name].shape, name  # gathered in full, not a shard
        assert torch.equal(p, params[1][name]), name
    assert any(not torch.equal(p, initial[name].detach()) for name, p in params[0].items())
    for log in records[0]["logs"]:  # the two step metrics that were never logged before
        assert 0 < log["perf/fwd_s"] < log["perf/fwd_bwd_s"]
        assert log["batch/groups_per_step"] >= 1


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_sharded_sync_sends_the_full_gathered_model(fsdp_run: Path, tiny_model_dir: Path) -> None:
    sent = torch.load(fsdp_run / "sent.pt")
    params = _load(fsdp_run, "full")[0]
    manifest = checkpoint_manifest(tiny_model_dir)
    assert sent.keys() == manifest.keys()
    for name, tensor in sent.items():
        assert tuple(tensor.shape) == manifest[name], name
        assert torch.equal(tensor, params[name]), name


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_sharded_resume_restores_the_model_and_the_prompt_position(fsdp_run: Path) -> None:
    saved = _load(fsdp_run, "full")[0]
    first = json.loads((fsdp_run / "full0.json").read_text())
    for rank in range(2):
        rec = json.loads((fsdp_run / f"resumed{rank}.json").read_text())
        assert rec["global_step"] == 3
        restored = torch.load(fsdp_run / f"resumed{rank}.pt")
        for name, p in saved.items():
            assert torch.equal(restored[name], p), name
    state = json.loads((fsdp_run / "resumed0.json").read_text())["resume_state"]
    assert state["first_untrained_position"] == first["position"] > 0
    assert state["policy_version"] == 2


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_sharded_lora_run_syncs_merged_weights(fsdp_run: Path, tiny_model_dir: Path) -> None:
    sent = torch.load(fsdp_run / "lora_sent.pt")
    lora = _load(fsdp_run, "lora")
    assert all(torch.equal(p, lora[1][n]) for n, p in lora[0].items())
    params = lora[0]
    assert sent.keys() == checkpoint_manifest(tiny_model_dir).keys()
    prefix = "base_model.model."
    for module in ("q_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{module}"
        a = params[f"{prefix}{name}.lora_A.default.weight"]
        b = params[f"{prefix}{name}.lora_B.default.weight"]
        base = params[f"{prefix}{name}.base_layer.weight"]
        assert b.abs().max() > 0, "the adapter did not train"
        torch.testing.assert_close(sent[f"{name}.weight"], base + (b @ a) * (8 / 4))
    k = f"{prefix}model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(sent["model.layers.0.self_attn.k_proj.weight"], params[k])
