"""Held-out evaluation through the same machinery as training: the vLLM server, the rollout loop's
multi-turn rollouts (:meth:`AsyncRolloutLoop.evaluate`) and the environment (local or on an env server).

    result = evaluate_policy(base_url, model_dir, remote_factory(url, "IncrementEnv"),
                             rows=[{"target": t} for t in range(1, 7)], samples_per_row=8)
    result.success_rate     # mean environment reward (1.0 = goal reached)
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import tempfile
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer

from trainer.config import AsyncGRPOConfig
from trainer.rollout.chat_template import rollout_family, stop_token_ids
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.worker import WorkerChannels
from trainer.vllm.admin import VLLMAdminClient
from trainer.vllm.server_info import read_server_info


@dataclass
class PolicyEval:
    """Outcome of an evaluation.

    Attributes:
        episodes: Rollouts run.
        success_rate: Mean environment reward.
        tool_calls_per_episode: Mean tool calls per rollout.
        failed_tool_call_frac: Failed tool calls / tool calls (0 when there are none).
    """

    episodes: int
    success_rate: float
    tool_calls_per_episode: float
    failed_tool_call_frac: float


def evaluate_policy(
    base_url: str,
    model_dir: str,
    environment_factory: Any,
    rows: list[dict[str, Any]],
    samples_per_row: int = 8,
    max_completion_length: int = 48,
    max_tool_calling_iterations: int = 8,
    temperature: float = 1.0,
    concurrency: int = 32,
) -> PolicyEval:
    """Run ``samples_per_row`` rollouts per row against the served policy; average the env rewards."""
    config = AsyncGRPOConfig(
        output_dir=tempfile.gettempdir(), vllm_server_base_url=base_url, num_generations=2, temperature=temperature,
        max_completion_length=max_completion_length, max_tool_calling_iterations=max_tool_calling_iterations,
        report_to="none", use_cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    channels = WorkerChannels.create(mp.get_context("spawn"), initial_allowance=0, initial_version=0)
    server = read_server_info(VLLMAdminClient(base_url, timeout_s=config.vllm_server_timeout))
    stops = stop_token_ids(tokenizer, rollout_family(tokenizer.chat_template))  # the family's, EOS included
    loop = AsyncRolloutLoop(config=config, model_name=model_dir, dataset=None, reward_funcs=[],
                            processing_class=tokenizer, eos_token_ids=stops, channels=channels,
                            environment_factory=environment_factory, max_model_len=server.max_model_len,
                            served_model=server.model)

    results = asyncio.run(loop.evaluate(rows, samples_per_row, concurrency))
    rewards = [e[1] if e is not None else 0.0 for _, _, e in results]
    calls = sum(r.tool_call_count for _, r, _ in results)
    failures = sum(r.tool_failure_count for _, r, _ in results)
    return PolicyEval(
        episodes=len(results),
        success_rate=sum(rewards) / len(results),
        tool_calls_per_episode=calls / len(results),
        failed_tool_call_frac=failures / calls if calls else 0.0,
    )
