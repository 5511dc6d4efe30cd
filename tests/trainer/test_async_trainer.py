"""AsyncGRPOTrainer end to end on the real vLLM CPU server and a real spawned rollout worker."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset, IterableDataset
from transformers import AutoModelForCausalLM, TrainerCallback

from tests.trainer.events import StopOnceLogged
from tests.trainer.spread_reward import token_reward
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import (
    ConfigError,
    RolloutWorkerError,
    VLLMServerError,
    WeightSyncError,
)
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig, free_port
from trainer.sync.weight_sync import WeightSynchronizer
from trainer.vllm.client import SamplerClient, SamplingParams

# Reward functions live at module level: they must pickle into the spawned worker.


def recording_reward(completion_ids: list[list[int]], row_id: list[int], path: str, **kwargs: Any) -> list[float]:
    """``token_reward`` that also appends the scored dataset rows to ``path``."""
    with open(path, "a") as f:
        f.write(f"{row_id[0]}\n")
    return token_reward(completion_ids)


def crashing_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Fails inside the worker."""
    raise RuntimeError("reward exploded on purpose")


async def loop_blocking_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Blocks the worker's event loop (a sync sleep inside a coroutine): the heartbeat stops."""
    time.sleep(120)
    return [0.0] * len(completions)


def _dataset(n: int = 12) -> Dataset:
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(n)],
        "row_id": list(range(n)),
    })


def _config(tmp_path: Path, server: VLLMServer | str, **overrides: Any) -> AsyncGRPOConfig:
    base_url = server if isinstance(server, str) else server.base_url
    kwargs: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=base_url, max_steps=3, num_generations=4,
        max_completion_length=16, learning_rate=1e-3, report_to="none", use_cpu=True,
        gradient_checkpointing=False, save_strategy="no", logging_steps=1, rollout_worker_timeout=60,
        vllm_server_timeout=60, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return AsyncGRPOConfig(**kwargs)


def _server_logprobs(base_url: str, prompt: list[int]) -> list[float]:
    async def go() -> list[float]:
        async with SamplerClient(base_url) as client:
            turn = await client.complete(prompt, SamplingParams(max_tokens=8, temperature=1.0, logprobs=1), seed=11)
            return turn.output_log_probs

    return asyncio.run(go())


def test_short_run_trains_syncs_and_logs(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer
) -> None:
    before = _server_logprobs(vllm_server.base_url, [5, 17, 42])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = AsyncGRPOTrainer(model=model, reward_funcs=token_reward, args=_config(tmp_path, vllm_server),
                               train_dataset=_dataset())
    trainer.train()

    assert trainer.state.global_step == 3
    assert trainer.stream.policy_version == 3  # one sync per step (weight_sync_steps=1)
    assert restore_served_weights.client.request("GET", "/weight_info")["weight_version"] == "3"
    after = _server_logprobs(vllm_server.base_url, [5, 17, 42])
    assert after != before, "the server must serve the trained weights"
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p.detach(), initial[n])]
    assert not unchanged, f"parameters that did not change: {unchanged}"
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    expected = {
        "reward", "reward_trained", "frac_zero_std_groups", "rewards/token_reward/mean", "entropy",
        "sampling/importance_sampling_ratio/mean", "sampling/sampler_mass", "clip_ratio/region_mean",
        "completions/mean_length", "rollout/generated_tokens_per_s", "rollout/concurrency_cap",
        "sample/staleness_mean", "batch/packing_ratio", "batch/trained_tokens_per_step", "perf/step_s",
        "perf/weight_sync_s", "perf/weight_sync_transfer_s", "perf/weight_sync_wait_s", "perf/rollout_wait_s",
        "num_tokens",
    }
    seen = set().union(*(h.keys() for h in trainer.state.log_history))
    assert expected <= seen, f"missing metrics: {sorted(expected - seen)}"
    assert trainer.worker is None, "the worker is stopped when train() returns"


def test_per_sample_packing_trains_through_the_stack(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer
) -> None:
    """packing="per_sample" (the way out for families tree packing refuses): the planner shares
    nothing, so every step's packing ratio is 1, and the run trains and syncs as with tree packing."""
    before = _server_logprobs(vllm_server.base_url, [5, 17, 42])
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=token_reward, train_dataset=_dataset(),
                               args=_config(tmp_path, vllm_server, max_steps=2, packing="per_sample"))
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.stream.policy_version == 2
    ratios = [h["batch/packing_ratio"] for h in trainer.state.log_history if "batch/packing_ratio" in h]
    assert ratios and all(r == 1.0 for r in ratios), ratios
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)
    assert _server_logprobs(vllm_server.base_url, [5, 17, 42]) != before, "the server must serve the update"


def test_staleness_drop_and_backpressure_show_in_metrics(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer
) -> None:
    # Whether a given step sees a stale sample or a blocked producer depends on how the two processes
    # are scheduled; over a run both happen, so the run goes on until both were logged (at most 40 steps).
    seen = StopOnceLogged("sample/dropped_stale_count", "rollout/backpressure_s")
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir), reward_funcs=token_reward, train_dataset=_dataset(),
        args=_config(tmp_path, vllm_server, max_steps=40, max_staleness=0, token_budget=200), callbacks=[seen])
    trainer.train()
    assert seen.totals["sample/dropped_stale_count"] > 0, "with max_staleness=0 queued samples go stale"
    assert seen.totals["rollout/backpressure_s"] > 0, "the worker waited for the allowance"
    assert trainer.state.global_step < 40, "both were logged before the step cap"
    assert max(h.get("sample/staleness_max", 0) for h in trainer.state.log_history) == 0


def test_resume_continues_at_the_saved_prompt(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, restore_served_weights: WeightSynchronizer
) -> None:
    scored = tmp_path / "scored.txt"
    reward = functools.partial(recording_reward, path=str(scored))
    args = _config(tmp_path, vllm_server, max_steps=2, save_strategy="steps", save_steps=2, max_staleness=1)
    AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward, args=args, train_dataset=_dataset(40)).train()
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "rollout_state.json").read_text())
    assert state["policy_version"] == 2 and state["first_untrained_position"] > 0

    scored.write_text("")
    args = _config(tmp_path, vllm_server, max_steps=3, save_strategy="no", max_staleness=1)
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=reward, args=args, train_dataset=_dataset(40))
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3
    assert trainer.stream.policy_version == 3
    # The worker restarted at the saved position, not at the start: at the very start it runs one
    # group at a time, so the first group scored is the prompt at that position, or past it when
    # the checkpoint counts it as done or partly trained (a step that packed part of its group).
    position = state["first_untrained_position"]
    while position in state["done_positions"]:
        position += 1
    epoch, offset = divmod(position, 40)
    order = list(range(40))
    random.Random(args.seed + epoch).shuffle(order)
    first_scored = int(scored.read_text().split()[0])
    assert first_scored == order[offset]


def test_worker_crash_raises_with_its_traceback(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=crashing_reward,
                               args=_config(tmp_path, vllm_server), train_dataset=_dataset())
    with pytest.raises(RolloutWorkerError, match="reward exploded on purpose") as info:
        trainer.train()
    assert "Traceback" in str(info.value)
    assert trainer.worker is None


def test_hung_worker_is_detected_and_stopped(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=loop_blocking_reward,
                               args=_config(tmp_path, vllm_server, rollout_worker_timeout=4), train_dataset=_dataset())
    t0 = time.monotonic()
    with pytest.raises(RolloutWorkerError, match="no heartbeat"):
        trainer.train()
    assert time.monotonic() - t0 < 60


def test_unpicklable_reward_is_refused_at_train(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=[token_reward, lambda **kw: [0.0]],
                               args=_config(tmp_path, "http://127.0.0.1:9"), train_dataset=_dataset())
    with pytest.raises(TypeError, match=r"reward_funcs\[1\].*cannot be pickled"):
        trainer.train()


def _no_rows() -> Iterator[dict[str, Any]]:
    yield from ()


@pytest.mark.parametrize("bad, message", [
    (Dataset.from_dict({"question": ["hi"]}), "no 'prompt' column"),
    (Dataset.from_dict({"prompt": ["plain text"]}), "must be conversational"),
    (Dataset.from_dict({"prompt": []}), "train_dataset is empty"),
    # Only the first row was checked once: a later plain-string prompt ended the run mid-way with a Jinja error.
    ([{"prompt": [{"role": "user", "content": "hi"}]}] * 5 + [{"prompt": "plain"}],
     r"train_dataset row 5: 'prompt' must be conversational.*got 'plain'"),
    (IterableDataset.from_generator(_no_rows), "yielded no row"),
])
def test_bad_dataset_is_refused(tiny_model_dir: Path, tmp_path: Path, bad: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=token_reward, train_dataset=bad,
                         args=_config(tmp_path, "http://127.0.0.1:9"))


@pytest.mark.parametrize("model", ["./no/such/model", "outputs/run/checkpoint-5", "/no/such/dir"])
def test_a_model_path_that_does_not_exist_is_named(tmp_path: Path, model: str) -> None:
    with pytest.raises(ConfigError, match=f"model '{model}' is not a directory on this machine"):
        AsyncGRPOTrainer(model=model, reward_funcs=token_reward, train_dataset=_dataset(),
                         args=_config(tmp_path, "http://127.0.0.1:9"))


def test_no_server_gives_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=token_reward, train_dataset=_dataset(),
                               args=_config(tmp_path, f"http://127.0.0.1:{free_port()}", vllm_server_timeout=2))
    with pytest.raises(VLLMServerError, match="could not reach the vLLM server"):
        trainer.train()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)  # signal 0: does any process of the group remain?
    except ProcessLookupError:
        return False
    return True


@pytest.mark.vllm
def test_server_dying_mid_run_gives_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = VLLMServer(VLLMServerConfig(model=str(tiny_model_dir), max_model_len=256)).start()
    assert server.process is not None
    pgid = os.getpgid(server.process.pid)
    try:
        class KillServerAfterFirstStep(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step == 1:
                    server.stop()

        trainer = AsyncGRPOTrainer(
            model=str(tiny_model_dir), reward_funcs=token_reward, train_dataset=_dataset(),
            args=_config(tmp_path, server, max_steps=20, vllm_server_timeout=10),
            callbacks=[KillServerAfterFirstStep()])
        t0 = time.monotonic()
        with pytest.raises((VLLMServerError, WeightSyncError, RolloutWorkerError), match="vLLM server|retries"):
            trainer.train()
        assert time.monotonic() - t0 < 120
        assert trainer.worker is None
        # stop() left no process of the server's group (its engine core and workers included):
        # killed ones may take a moment to be reaped, none may remain.
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(pgid), "processes of the server's group outlived stop()"
    finally:
        server.stop()
