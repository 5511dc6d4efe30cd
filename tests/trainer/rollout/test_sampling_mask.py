"""Top-k / top-p sampling is unbiased: the trainer renormalises over each token's candidate set.

On the real vLLM CPU server (``--logprobs-mode processed_logprobs``, ``--max-logprobs 20``), before any
weight update, the trainer's log-prob of every sampled token, renormalised over the candidate set the
server reported, matches the server's processed log-prob (importance ratio ~1 on every token); over the
full vocabulary it does not (the bias TRL's AsyncGRPOTrainer docs describe). The measured bias is printed
(``pytest -s``). The source's own path (``--return-sampling-mask``, Model Runner V2) cannot run on the CPU
build; its answer parsing is checked on the route's response shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from tests.trainer.spread_reward import token_reward
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import ConfigError, RolloutWorkerError, VLLMServerError
from trainer.launch.vllm_server import VLLMServer
from trainer.records import TrainingSample, TurnRecord
from trainer.rollout.reconcile import reconcile_turns
from trainer.training.logprobs import forward_packed
from trainer.training.loss import LossConfig, grpo_loss, loss_metrics
from trainer.training.packing import build_row
from trainer.training.tree_attention import enable_tree_attention
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.client import SamplerClient, SamplingParams, _generate_turn
from trainer.vllm.server_info import (
    ServerInfo,
    candidate_path,
    check_turn_length,
    dtype_mismatch,
    read_server_info,
)

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8, 64], [77, 78, 79, 80, 81, 82], [1000, 3, 250]]
TEMPERATURE = 1.5
SETTINGS = {"top_k=5": dict(top_k=5, top_p=1.0), "top_k=20, top_p=0.5": dict(top_k=20, top_p=0.5)}
PROCESSED = ServerInfo(model="m", max_model_len=1024, dtype="float32", logprobs_mode="processed_logprobs",
                       max_logprobs=20)


def _sample(base_url: str, top_k: int, top_p: float) -> list[TurnRecord]:
    async def go() -> list[TurnRecord]:
        params = SamplingParams(max_tokens=24, temperature=TEMPERATURE, top_k=top_k, top_p=top_p, logprobs=4,
                                candidates="processed_topk")
        async with SamplerClient(base_url, seed=0) as client:
            return list(await asyncio.gather(*(client.complete(p, params) for p in PROMPTS)))

    return asyncio.run(go())


def _samples(turns: list[TurnRecord], keep_candidates: bool) -> list[TrainingSample]:
    samples = []
    for i, turn in enumerate(turns):
        (seq,), _ = reconcile_turns([turn])
        if not keep_candidates:
            seq = dataclasses.replace(seq, sampling_masks=None)
        samples.append(TrainingSample(sequence=seq, advantage=1.0 if i % 2 else -1.0, group_id=i, policy_version=0))
    return samples


def _trainer_vs_sampler(model: torch.nn.Module, turns: list[TurnRecord],
                        keep_candidates: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """|log p - log q| per trained token, and the loss's sampling/* metrics, over one packed row."""
    row = build_row(_samples(turns, keep_candidates))
    with torch.no_grad():
        logps = forward_packed(model, row, TEMPERATURE)
        _, stats = grpo_loss(logps, row, LossConfig(), row.num_trained)
    return (logps.logp - row.sampler_logprobs).abs(), loss_metrics(stats)


@pytest.mark.vllm
def test_candidate_sets_make_the_importance_ratio_one(vllm_server: VLLMServer, tiny_model_dir: Path) -> None:
    info = read_server_info(VLLMAdminClient(vllm_server.base_url, timeout_s=60))
    assert (info.logprobs_mode, info.max_logprobs, info.dtype) == ("processed_logprobs", 20, "float32")
    assert candidate_path(info, top_k=5, top_p=1.0, min_p=None) == "processed_topk"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    enable_tree_attention(model)
    model.eval()
    for name, setting in SETTINGS.items():
        turns = _sample(vllm_server.base_url, **setting)
        for turn in turns:
            assert turn.output_sampling_mask is not None and len(turn.output_sampling_mask) == len(turn.output_ids)
            for token, candidates in zip(turn.output_ids, turn.output_sampling_mask, strict=True):
                assert token in candidates and len(candidates) <= setting["top_k"]
        unbiased, metrics = _trainer_vs_sampler(model, turns, keep_candidates=True)
        biased, full_metrics = _trainer_vs_sampler(model, turns, keep_candidates=False)
        print(f"\n{name}, temperature {TEMPERATURE}, {unbiased.numel()} sampled tokens: |log p - log q| "
              f"renormalised mean {unbiased.mean():.2e} max {unbiased.max():.2e}; full vocabulary "
              f"mean {biased.mean():.3f} max {biased.max():.3f}")
        assert unbiased.max() < 1e-3
        assert biased.mean() > 0.1  # the full-vocabulary probability is lower than the candidate set's
        assert 0.999 < metrics["sampling/importance_sampling_ratio/min"] <= metrics[
            "sampling/importance_sampling_ratio/max"] < 1.001
        assert metrics["sampling/masked_mean"] == 0.0
        assert full_metrics["sampling/importance_sampling_ratio/mean"] < 0.9
        assert full_metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(float(biased.mean()), rel=1e-4)


@pytest.mark.vllm
def test_top_k_over_max_logprobs_is_refused_at_start_naming_the_flag(vllm_server: VLLMServer) -> None:
    info = read_server_info(VLLMAdminClient(vllm_server.base_url, timeout_s=60))
    with pytest.raises(ConfigError, match="--max-logprobs 50"):
        candidate_path(info, top_k=50, top_p=1.0, min_p=None)


@pytest.mark.vllm
def test_a_turn_over_max_model_len_stops_without_truncation_and_is_cut_with_it(vllm_server: VLLMServer) -> None:
    info = read_server_info(VLLMAdminClient(vllm_server.base_url, timeout_s=60))
    long_prompt = [(7 * i) % 500 + 3 for i in range(info.max_model_len - 8)]

    async def turn(top_k: int, prompt: list[int]) -> TurnRecord:
        params = SamplingParams(max_tokens=32, temperature=1.0, top_k=top_k, logprobs=1,
                                candidates="processed_topk" if top_k else None)
        max_tokens = check_turn_length(len(prompt), params.max_tokens, info.max_model_len, top_k > 0)
        async with SamplerClient(vllm_server.base_url, seed=0) as client:
            return await client.complete(prompt, dataclasses.replace(params, max_tokens=max_tokens))

    with pytest.raises(VLLMServerError, match=r"maximum context length is 1024 tokens.*raise --max-model-len"):
        asyncio.run(turn(0, long_prompt))
    cut = asyncio.run(turn(5, long_prompt))
    assert len(long_prompt) + len(cut.output_ids) <= info.max_model_len
    assert len(cut.output_ids) == 8 or cut.finish_reason == "stop"
    with pytest.raises(VLLMServerError, match="already has 1024"):
        asyncio.run(turn(5, long_prompt + [3] * 8))


def test_the_warning_is_only_for_a_server_with_neither_path(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert candidate_path(PROCESSED, top_k=5, top_p=1.0, min_p=None) == "processed_topk"
        mask = dataclasses.replace(PROCESSED, return_sampling_mask=True, scale_out=True, max_logprobs=0)
        assert candidate_path(mask, top_k=512, top_p=0.95, min_p=None) == "sampling_mask"
        assert candidate_path(dataclasses.replace(PROCESSED, logprobs_mode="raw_logprobs"), 0, 1.0, None) is None
        assert not caplog.records
        raw = dataclasses.replace(PROCESSED, logprobs_mode="raw_logprobs")
        assert candidate_path(raw, top_k=5, top_p=1.0, min_p=None) == "full_vocab"
    assert [r.getMessage() for r in caplog.records if "biased" in r.getMessage()]


def test_dtype_mismatch_is_named() -> None:
    assert dtype_mismatch(PROCESSED, "float32") is None
    message = dtype_mismatch(PROCESSED, "bfloat16")
    assert message is not None and "--dtype float32" in message and "serve with --dtype bfloat16" in message


def test_the_sampling_mask_route_answer_gives_the_candidate_sets() -> None:
    # The shape of vLLM 0.32's /inference/v1/generate answer with --return-sampling-mask (the CPU build
    # cannot run Model Runner V2, which that flag needs, so no real server answers it here).
    data = {"choices": [{"index": 0, "token_ids": [5, 9], "finish_reason": "length", "sampling_mask": [[5, 6], [9]],
                         "logprobs": {"content": [
                             {"token_id": 5, "logprob": -0.3, "top_logprobs": [{"token_id": 5, "logprob": -0.3},
                                                                               {"token_id": 6, "logprob": -1.35}]},
                             {"token_id": 9, "logprob": 0.0, "top_logprobs": [{"token_id": 9, "logprob": 0.0},
                                                                              {"token_id": 2, "logprob": -9999.0}]}]}}]}
    turn = _generate_turn([1, 2], data, num_top=2)
    assert turn.output_sampling_mask == [[5, 6], [9]]
    assert turn.output_log_probs == [-0.3, 0.0]
    assert turn.output_sampler_logprobs == [{5: -0.3, 6: -1.35}, {9: 0.0}]
    data["choices"][0]["sampling_mask"] = [[5]]
    with pytest.raises(VLLMServerError, match="1 candidate sets for 2 tokens"):
        _generate_turn([1, 2], data, num_top=2)


@pytest.mark.vllm
def test_a_run_whose_turn_overflows_max_model_len_stops_with_the_error(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    long_prompt = [{"role": "user", "content": " ".join(f"w{i}" for i in range(280))}]  # 1000-odd tokens: + 64 > 1024
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), vllm_server_base_url=vllm_server.base_url, max_steps=2, num_generations=2,
        max_completion_length=64, report_to="none", use_cpu=True, gradient_checkpointing=False, save_strategy="no",
        rollout_worker_timeout=60, vllm_server_timeout=60, disable_tqdm=True)
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=token_reward, args=args,
                               train_dataset=Dataset.from_dict({"prompt": [long_prompt] * 2}))
    with pytest.raises(RolloutWorkerError, match="context length is 1024 tokens.*max_completion_length=64 in"):
        trainer.train()
