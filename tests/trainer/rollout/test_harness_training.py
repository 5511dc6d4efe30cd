"""Harness mode against the real vLLM CPU server: an ``openai``-client agent trains the warm counter model.

One training run carries most assertions (starting a trainer costs more than checking it): the
agent (``harness_agents.counter_agent``) calls the counter environment's ``increment`` through
function calling on its rollout's endpoint, streamed or not, and some rollouts rewrite their
history, crash or hang. A command agent (a script on the ``openai`` client, reading
``OPENAI_BASE_URL``) runs through the same loop against the same server.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from environments.counter import IncrementEnv
from tests.trainer.rollout.harness_agents import RecordingHarnessTrainer, counter_agent
from toolgym.kit.counter_experiment import counter_dataset, serve_policy
from trainer.config import AsyncGRPOConfig
from trainer.exceptions import ConfigError
from trainer.harness_trainer import HarnessAsyncGRPOConfig, HarnessAsyncGRPOTrainer
from trainer.launch.vllm_server import VLLMServer
from trainer.rewards import tool_error_penalty
from trainer.rollout.harness_loop import HarnessRolloutLoop, HarnessSettings
from trainer.rollout.settings import RolloutSettings
from trainer.sync.weight_sync import WeightSynchronizer
from trainer.vllm.server_info import ServerInfo

STEPS = 3
AGENT_TIMEOUT_S = 20.0  # a hanging rollout costs this; a loaded CPU can take seconds per turn


def _config(output_dir: Path, base_url: str, **overrides: Any) -> HarnessAsyncGRPOConfig:
    fields: dict[str, Any] = dict(
        output_dir=str(output_dir), vllm_server_base_url=base_url, max_steps=STEPS, num_generations=4,
        max_completion_length=48, learning_rate=2e-4, gradient_accumulation_steps=2, use_cpu=True,
        gradient_checkpointing=False, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        max_staleness=2, agent_timeout=AGENT_TIMEOUT_S)
    fields.update(overrides)
    return HarnessAsyncGRPOConfig(**fields)


@pytest.mark.vllm
@pytest.mark.timeout(1800)  # the session's warm start (about two minutes) may run in this test's setup
def test_an_openai_agent_trains_through_the_endpoint(
    vllm_server: VLLMServer, warm_counter_model_dir: Path, restore_served_weights: WeightSynchronizer,
    tmp_path: Path,
) -> None:
    serve_policy(vllm_server.base_url, warm_counter_model_dir)
    trainer = RecordingHarnessTrainer(
        model=str(warm_counter_model_dir), agent=counter_agent, reward_funcs=tool_error_penalty,
        args=_config(tmp_path, vllm_server.base_url), train_dataset=counter_dataset(),
        environment_factory=IncrementEnv)
    trainer.train()

    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == STEPS and trainer.stream.policy_version == STEPS, "a weight sync per step"
    # Step 1 trains only samples of policy version 0, whose weights the trainer still holds: the
    # log-probs captured at the endpoint are the server's for exactly those tokens.
    assert steps[0]["sampling/sampling_logp_difference/max"] < 1e-3  # measured: 5e-6
    assert steps[0]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=0.01)
    logged = {k for h in trainer.state.log_history for k in h}
    for name in ("agent/duration_s", "agent/requests_mean", "tools/call_frequency", "tools/increment/call_count",
                 "tools/latency_s", "rollout/turns_mean", "rollout/samples_per_rollout", "completions/mean_length",
                 "rewards/IncrementEnv/mean", "rewards/tool_error_penalty/mean"):
        assert name in logged, name
    total = {k: sum(h.get(k, 0) for h in trainer.state.log_history) for k in (
        "agent/timeout_count", "agent/failed_count", "rollout/failed_count")}
    assert total["agent/timeout_count"] >= 1 and total["agent/failed_count"] >= 1
    # Each agent failure fails its rollout. A step logs the records that came with its group; the agent's
    # counts are recorded a loop turn before its rollout's failure, so the rollouts of one group whose
    # deadlines fire together may have their agent counts in the last group trained and their failures
    # in a group the run never trains: at most a group's worth.
    failed = total["agent/timeout_count"] + total["agent/failed_count"]
    assert total["rollout/failed_count"] >= failed - trainer.args.num_generations

    records = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    ok = [r for r in records if "trained" in r]  # (rollouts cancelled when the run stopped have neither key)
    assert {r["mode"] for r in ok} >= {"normal", "stream", "rewrite"}
    for r in ok:  # every generated token is trained exactly once, and it is what the agent was sent
        assert r["trained"] == r["generated"] and len(r["generated"]) == r["seen_tokens"]
        assert r["sequences"] == 1 + r["forks"]
        if r["mode"] in ("normal", "stream"):
            assert r["forks"] == 0, "an agent sending its history back extends one sample"
    rewrites = [r for r in ok if r["mode"] == "rewrite" and r["turns"] >= 2]
    assert rewrites and all(r["forks"] == r["turns"] - 1 for r in rewrites), "a rewritten history forks"
    called = [r for r in ok if r["mode"] == "normal" and r["tool_calls"]]
    assert called and all(m["role"] == "tool" for r in called for m in r["completion"][1:2]), \
        "reward functions see the captured conversation, tool results included"
    failed = {r["mode"]: r["failed"] for r in records if "failed" in r}
    assert "RuntimeError: the agent's parser broke" in failed["crash"]
    assert "deadline" in failed["hang"]


SCRIPT = textwrap.dedent('''
    """A command agent: the task on stdin, the endpoint from OPENAI_BASE_URL, the reward printed last."""
    import json, os, sys
    import openai

    task = json.load(sys.stdin)
    client = openai.OpenAI(max_retries=0)
    messages = task["prompt"]
    reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, max_tokens=12)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Once more."}]
    again = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, max_tokens=12)
    print(reply.usage.completion_tokens + again.usage.completion_tokens)
''')


@pytest.mark.vllm
def test_a_command_agent_runs_a_rollout(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(SCRIPT)
    config = _config(tmp_path, vllm_server.base_url, agent_timeout=180)  # Python + openai start in seconds
    settings = RolloutSettings.from_config(config, str(tiny_model_dir),
                                           ServerInfo(model=str(tiny_model_dir), max_model_len=1024))
    loop = HarnessRolloutLoop(settings, AutoTokenizer.from_pretrained(tiny_model_dir),
                              agent=[sys.executable, str(script)], harness=HarnessSettings.from_config(config))

    async def go() -> list[Any]:
        await loop.setup()
        try:
            row = {"prompt": [{"role": "user", "content": "Say something."}]}
            return await asyncio.gather(loop.scheduler.one_rollout(row, 0), loop.scheduler.one_rollout(row, 0))
        finally:
            await loop.sampler.close()
            await loop.close()

    for _, rollout, _ in asyncio.run(go()):
        assert len(rollout.turns) == 2 and rollout.reward == len(rollout.completion_ids)
        assert all(0 < len(t.output_ids) <= 12 for t in rollout.turns)
        # The second request sent the first reply back: one sample, unless re-tokenizing its text differs.
        assert rollout.turns[1].prompt_ids[: len(rollout.turns[0].prompt_ids)] == rollout.turns[0].prompt_ids


def test_the_trainer_refuses_what_cannot_reach_the_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    async def closure_agent(task: Any) -> None:  # defined in a function: it cannot be pickled
        return None

    rows = Dataset.from_dict({"task": ["fix the bug", "write the test"]})  # no prompt: the agent reads the row
    config = _config(tmp_path, "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="HarnessAsyncGRPOConfig"):
        HarnessAsyncGRPOTrainer(model=str(tiny_model_dir), agent=counter_agent, train_dataset=rows,
                                args=AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    with pytest.raises(ConfigError, match="async function"):
        HarnessAsyncGRPOTrainer(model=str(tiny_model_dir), agent=lambda task: 0.0, args=config, train_dataset=rows)
    trainer = HarnessAsyncGRPOTrainer(model=str(tiny_model_dir), agent=closure_agent, args=config, train_dataset=rows)
    with pytest.raises(TypeError, match="agent .* cannot be pickled"):
        trainer.train()
