"""No silent stall on the real stack: a run that can train nothing says why within seconds of the first
warning bound and stops at ``stall_timeout`` with PipelineStalledError and a checkpoint (real vLLM CPU
server, real rollout worker): a constant reward, a reward of ``None`` or ``nan``, a model that never calls
the environment's tool, a tool that fails at every call."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset

from environments.counter import IncrementEnv
from toolgym.kit.counter_experiment import serve_policy
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import PipelineStalledError
from trainer.launch.vllm_server import VLLMServer
from trainer.sync.weight_sync import WeightSynchronizer

pytestmark = pytest.mark.vllm


def constant_or_nothing(completion_ids: list[list[int]], kind: list[str], **kwargs: Any) -> list[float | None]:
    """The same reward for every rollout (no spread), or ``None`` / ``nan`` (unscorable), by the row's kind;
    ``None`` for the counter's rows, scored by the counter alone."""
    value = {"constant": 1.0, "none": None, "nan": float("nan"), "never_calls": None}[kind[0]]
    return [value] * len(completion_ids)


class PlainEnv:
    """An environment with a tool and no reward of its own."""

    def reset(self, **kwargs: Any) -> None:
        """Nothing to set up: the row's prompt is the whole prompt."""

    def get_reward(self) -> None:
        """No reward: the row's reward function scores the rollout."""

    def noop(self) -> str:
        """Do nothing."""
        return ""


class WatchedCounter(IncrementEnv):
    """The counter, writing one line per episode scored (``calls=N counter=C``) to ``log``; with
    ``fail``, its tool raises at every call (a backend that is down)."""

    def __init__(self, log: str, fail: bool = False) -> None:
        super().__init__()
        self.log, self.fail, self.calls = log, fail, 0

    def reset(self, target: int | None = None, seed: int | None = None, **kwargs: object) -> str:
        """Start an episode (:meth:`IncrementEnv.reset`)."""
        self.calls = 0
        return super().reset(target=target, seed=seed, **kwargs)

    def increment(self, step: int) -> int:
        self.calls += 1
        if self.fail:
            raise RuntimeError("the counter service is down")
        return super().increment(step)

    # The parent's docstring: the tool's schema stays the one the warm-started model was taught.
    increment.__doc__ = IncrementEnv.increment.__doc__

    def get_reward(self) -> float:
        """1.0 when the counter equals the target, else 0.0; the episode is logged."""
        with open(self.log, "a") as f:
            f.write(f"calls={self.calls} counter={self.counter}\n")
        return super().get_reward()


def _episodes(log: Path) -> list[tuple[int, int]]:
    """``(calls, counter)`` of each episode a :class:`WatchedCounter` scored."""
    pairs = [[int(part.split("=")[1]) for part in line.split()] for line in log.read_text().splitlines()]
    return [(calls, counter) for calls, counter in pairs]


def test_a_run_that_can_train_nothing_says_why_and_stops(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=vllm_server.base_url, max_steps=5,
        num_generations=4, max_completion_length=8, report_to="none", use_cpu=True, gradient_checkpointing=False,
        save_strategy="no", rollout_worker_timeout=60, vllm_server_timeout=60, disable_tqdm=True, stall_timeout=36)
    kinds = ["constant", "none", "nan", "never_calls"] * 30
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"Say {i}."}] for i in range(len(kinds))], "kind": kinds,
        "environment": ["counter" if kind == "never_calls" else "plain" for kind in kinds], "target": [3] * len(kinds),
    })
    log = tmp_path / "episodes.log"
    factories: dict[str, Callable[[], Any]] = {"plain": PlainEnv,
                                               "counter": functools.partial(WatchedCounter, str(log))}
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=constant_or_nothing, train_dataset=dataset,
                               args=args, environment_factory=factories)
    with pytest.raises(PipelineStalledError, match=r"no trainable sample for 3\d s of waiting") as stalled:
        trainer.train()
    message = str(stalled.value)
    assert re.search(r"[1-9]\d* for zero reward spread", message) and re.search(r"[1-9]\d* unscorable", message)
    warnings = [r.getMessage() for r in caplog.records if "no trainable sample for" in r.getMessage()]
    assert len(warnings) >= 5, "warned every 5 s before stopping, with the counts"
    stalls = [h for h in trainer.state.log_history if "pipeline/stalled_s" in h]
    assert stalls and stalls[0]["pipeline/stalled_s"] < 12, "the first report comes within seconds of its bound"
    assert (tmp_path / "out" / "checkpoint-0" / "rollout_state.json").exists(), "a checkpoint, save_strategy='no'"
    # The random tiny model never calls the counter's tool: every counter episode scored 0 alike.
    episodes = _episodes(log)
    assert episodes and all(calls == 0 and counter == 0 for calls, counter in episodes)


def test_a_tool_that_fails_at_every_call_stops_the_run_saying_why(
    vllm_server: VLLMServer, warm_counter_model_dir: Path, restore_served_weights: WeightSynchronizer,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # The warm-started model calls the counter's tool; every call fails, so no counter moves and every
    # rollout scores 0: nothing to train on. (restore_served_weights puts the tiny model back after.)
    caplog.set_level(logging.WARNING)
    serve_policy(vllm_server.base_url, warm_counter_model_dir)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=vllm_server.base_url, max_steps=5,
        num_generations=4, max_completion_length=48, max_tool_calling_iterations=3, report_to="none",
        use_cpu=True, gradient_checkpointing=False, save_strategy="no", rollout_worker_timeout=60,
        vllm_server_timeout=60, disable_tqdm=True, stall_timeout=12)
    log = tmp_path / "episodes.log"
    trainer = AsyncGRPOTrainer(model=str(warm_counter_model_dir), args=args,
                               train_dataset=Dataset.from_dict({"target": [2, 3] * 40}),
                               environment_factory=functools.partial(WatchedCounter, str(log), fail=True))
    with pytest.raises(PipelineStalledError, match=r"no trainable sample for 1\d s of waiting") as stalled:
        trainer.train()
    assert re.search(r"[1-9]\d* for zero reward spread", str(stalled.value))
    assert any("no trainable sample for" in r.getMessage() for r in caplog.records), "warned before stopping"
    episodes = _episodes(log)
    assert sum(calls for calls, _ in episodes) >= 1, "the model called the tool"
    assert all(counter == 0 for _, counter in episodes), "and every call failed"
