"""``RolloutSettings``: what reaches the rollout worker instead of the trainer's config."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from tests.trainer.rollout.test_scoring import STUB_TOKENIZER, make_group, stub_settings
from trainer.config import AsyncGRPOConfig
from trainer.harness_config import HarnessAsyncGRPOConfig
from trainer.rollout.harness_loop import HarnessSettings
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.settings import RolloutSettings
from trainer.vllm.server_info import ServerInfo

SERVER = ServerInfo(model="served", max_model_len=512, kv_cache_tokens=4096)
CONFIG_NAMED = [f.name for f in dataclasses.fields(RolloutSettings)
                if f.name in {c.name for c in dataclasses.fields(AsyncGRPOConfig)}]


def test_from_config_copies_every_field_the_config_has(tmp_path) -> None:
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, vllm_server_base_url="http://10.0.0.1:8001",
        vllm_server_timeout=7.0, seed=3, num_generations=4, max_completion_length=33, temperature=0.7, top_p=0.9,
        top_k=20, min_p=0.05, num_sampler_logprobs=2, chat_template_kwargs='{"enable_thinking": false}',
        max_tool_calling_iterations=3, max_concurrent_rollouts=9, max_staleness=1, reward_timeout=5.0,
        mask_truncated_completions=True)
    settings = RolloutSettings.from_config(config, "org/model", SERVER, chat_template="T", candidates="processed_topk",
                                           lora_name="adapter")
    for name in CONFIG_NAMED:
        assert getattr(settings, name) == getattr(config, name), name
    assert settings.chat_template_kwargs == {"enable_thinking": False}
    assert (settings.model_name, settings.server, settings.chat_template, settings.candidates, settings.lora_name) == (
        "org/model", SERVER, "T", "processed_topk", "adapter")


def test_defaults_are_the_configs_and_the_settings_pickle(tmp_path) -> None:
    settings = stub_settings()
    config = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    for name in CONFIG_NAMED:
        if name != "vllm_server_base_url":  # required: there is no server by default
            assert getattr(settings, name) == (getattr(config, name) if name != "chat_template_kwargs" else {}), name
    assert pickle.loads(pickle.dumps(settings)) == settings  # it crosses into the spawned worker
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.temperature = 0.5  # type: ignore[misc]


def test_harness_settings_come_from_the_harness_config(tmp_path) -> None:
    config = HarnessAsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, agent_timeout=9.0,
                                    harness_port=1234)
    harness = HarnessSettings.from_config(config)
    assert (harness.agent_timeout, harness.harness_port) == (9.0, 1234)
    assert HarnessSettings().agent_max_requests == config.agent_max_requests


def test_the_loop_reads_the_server_facts_from_its_settings() -> None:
    loop = AsyncRolloutLoop(stub_settings(server=SERVER, max_concurrent_rollouts=64), STUB_TOKENIZER)
    try:
        assert loop.sampler.model == "served"
        assert loop.scheduler.cap.limit == 4096 // 512, "the first cap: KV-cache tokens / max_model_len"
        assert loop.policy_version == 0 and loop.eos_token_ids == [0]
    finally:
        loop.executor.shutdown()


def test_the_former_names_still_read_with_a_warning_naming_the_new_ones() -> None:
    loop = AsyncRolloutLoop(stub_settings(max_staleness=2), STUB_TOKENIZER)
    try:
        with pytest.warns(FutureWarning, match=r"AsyncRolloutLoop.config is deprecated .* read self.settings"):
            assert loop.config.max_staleness == 2
    finally:
        loop.executor.shutdown()
    with pytest.warns(FutureWarning, match="RolloutGroup.model_version is deprecated .* read policy_version"):
        assert make_group(2).model_version == 0
