"""``AsyncGRPOConfig``: its defaults and the cross-field rules of ``_validate``."""

from __future__ import annotations

import pytest
import torch

import trainer.config as config_module
from trainer.config import AsyncGRPOConfig
from trainer.exceptions import ConfigError


@pytest.fixture()
def make_config(tmp_path):
    def make(**kwargs) -> AsyncGRPOConfig:
        return AsyncGRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, **kwargs)

    return make


DEFAULTS = {
    "num_generations": 8,
    "max_completion_length": 2048,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "chat_template_kwargs": None,
    "max_tool_calling_iterations": None,
    "vllm_server_base_url": "http://localhost:8000",
    "vllm_server_timeout": 1800,
    "epsilon": 0.2,
    "epsilon_high": None,
    "score_centering": True,
    "vllm_importance_sampling_clip_min": 0.5,
    "vllm_importance_sampling_clip_max": 5.0,
    "num_sampler_logprobs": 8,
    "tail_token_prob": 1e-3,
    "grad_spike_clip": 3.0,
    "token_budget": None,
    "max_concurrent_rollouts": 512,
    "max_staleness": 4,
    "staleness_allowance": "capacity",
    "weight_sync_steps": 1,
    "rollout_worker_timeout": 300,
    "log_completions": False,
    "num_completions_to_print": None,
    "dtype": "float32",
    "trust_remote_code": False,
    "router_aux_loss_coef": None,
    "model_init_kwargs": None,
    # TrainingArguments defaults this trainer changes
    "logging_steps": 1,
    "gradient_checkpointing": True,
    "learning_rate": 1e-6,
    "lr_scheduler_type": "constant",
    "ignore_data_skip": True,
    "remove_unused_columns": False,
}


@pytest.mark.parametrize(("field", "value"), DEFAULTS.items(), ids=DEFAULTS.keys())
def test_default(make_config, field, value):
    got = getattr(make_config(), field)
    assert got == value
    if value is None or isinstance(value, bool):
        assert got is value


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only resolution")
def test_bf16_defaults_off_without_bf16_hardware(make_config):
    assert make_config().bf16 is False


@pytest.mark.parametrize(("supported", "kwargs", "bf16"), [
    (True, {}, True),                   # bf16 unless fp16, where supported
    (True, {"fp16": True}, False),
    (True, {"bf16": False}, False),     # an explicit choice is kept
    (False, {}, False),
])
def test_bf16_resolution(make_config, monkeypatch, supported, kwargs, bf16):
    monkeypatch.setattr(config_module, "_bf16_supported", lambda: supported)
    assert make_config(**kwargs).bf16 is bf16


def test_json_string_kwargs_are_parsed(make_config):
    config = make_config(chat_template_kwargs='{"enable_thinking": false}', model_init_kwargs='{"revision": "v1"}')
    assert config.chat_template_kwargs == {"enable_thinking": False}
    assert config.model_init_kwargs == {"revision": "v1"}


INVALID = [
    ({"remove_unused_columns": True}, r"remove_unused_columns must stay False"),
    ({"num_generations": 1}, r"num_generations=1"),
    ({"num_generations": 0}, r"num_generations=0"),
    ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
    ({"top_p": 1.5, "top_k": 50}, r"top_p=1.5 must be in \(0, 1\]"),
    ({"top_k": -1}, r"top_k=-1 must be >= 0"),
    ({"top_p": 0.9}, r"top_p=0.9 / min_p=None need top_k"),
    ({"min_p": 0.1}, r"top_p=1.0 / min_p=0.1 need top_k"),
    ({"min_p": 1.5, "top_k": 50}, r"min_p=1.5 must be in \[0, 1\]"),
    ({"min_p": -0.1, "top_k": 50}, r"min_p=-0.1 must be in \[0, 1\]"),
    ({"min_p": -0.1}, r"min_p=-0.1 must be in \[0, 1\]"),
    ({"temperature": 0.0}, r"temperature=0.0 must be > 0"),
    ({"temperature": -1.0}, r"temperature=-1.0 must be > 0"),
    ({"vllm_importance_sampling_clip_min": 0.0}, r"vllm_importance_sampling_clip_min.*got 0.0 and 5.0"),
    ({"vllm_importance_sampling_clip_min": 1.5}, r"vllm_importance_sampling_clip_min.*got 1.5 and 5.0"),
    ({"vllm_importance_sampling_clip_max": 0.9}, r"vllm_importance_sampling_clip_max, got 0.5 and 0.9"),
    ({"max_concurrent_rollouts": 0}, r"max_concurrent_rollouts=0 must be >= 1"),
    ({"weight_sync_steps": 0}, r"weight_sync_steps=0 must be >= 1"),
    ({"max_completion_length": 0}, r"max_completion_length=0 must be >= 1"),
    ({"num_sampler_logprobs": 0}, r"num_sampler_logprobs=0 must be >= 1"),
    ({"max_staleness": -1}, r"max_staleness=-1 must be >= 0"),
    ({"token_budget": 0}, r"token_budget=0 must be >= 1"),
    ({"dtype": "float64"}, r"dtype='float64' must be one of"),
    ({"staleness_allowance": "steps"}, r"staleness_allowance='steps' must be one of \('capacity', 'consumed'\)"),
    ({"tail_token_prob": 1.0}, r"tail_token_prob=1.0 must be in \[0, 1\)"),
    ({"tail_token_prob": -0.1}, r"tail_token_prob=-0.1 must be in \[0, 1\)"),
    ({"grad_spike_clip": 1.0}, r"grad_spike_clip=1.0 must be > 1"),
    ({"grad_spike_clip": float("nan")}, r"grad_spike_clip=nan must be > 1"),
]


@pytest.mark.parametrize(("kwargs", "match"), INVALID, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(INVALID)])
def test_invalid_raises_config_error(make_config, kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        make_config(**kwargs)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs", [
    {"top_p": 0.9, "top_k": 50},
    {"min_p": 0.05, "top_k": 50},
    {"min_p": 0.0},                     # min_p 0 filters nothing: no top_k needed
    {"top_k": 20},
    {"top_p": 1.0, "min_p": 1.0, "top_k": 1},
    {"vllm_importance_sampling_clip_min": 1.0, "vllm_importance_sampling_clip_max": 1.0},
    {"max_staleness": 0},
    {"num_generations": 2},
    {"token_budget": 1},
    {"dtype": "auto"},
    {"dtype": "bfloat16"},
    {"temperature": 0.01},
    {"staleness_allowance": "consumed"},
    {"tail_token_prob": None},
    {"tail_token_prob": 0.0},
])
def test_valid_edge_values(make_config, kwargs):
    config = make_config(**kwargs)
    for name, value in kwargs.items():
        assert getattr(config, name) == value


def test_a_trainer_leaves_the_callers_config_as_given(tmp_path, tiny_model_dir):
    # The epoch stop needs a step cap inside the trainer; reusing the same config must still stop by epochs.
    from datasets import Dataset

    from trainer import AsyncGRPOTrainer

    config = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=2)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    first = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=len, train_dataset=dataset, args=config)
    assert config.max_steps == -1 and first.args.max_steps > 0
    second = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=len, train_dataset=dataset, args=config)
    assert second._explicit_max_steps is False


def test_the_former_name_of_the_consumed_rule_is_read_with_a_warning_naming_the_new_one(make_config):
    # "source" is in users' YAML files: it still works for a release.
    with pytest.warns(FutureWarning, match=r"staleness_allowance='source' is deprecated .* toolgym 0.2: write "
                                           r"staleness_allowance='consumed'"):
        config = make_config(staleness_allowance="source")
    assert config.staleness_allowance == "consumed"
