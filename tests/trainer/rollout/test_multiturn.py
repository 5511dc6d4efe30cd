"""Multi-turn agent rollouts on the real vLLM server: local and remote environments, routing, failures.

The shared server is switched to a warm-started tiny model (it emits well-formed tool calls) through
a real weight sync; ``restore_served_weights`` puts the original weights back afterwards.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import get_json_schema

from environments.counter import IncrementEnv
from envserver import EnvSpec, ServerConfig, ServerThread
from sdk import environment_tools, remote_factory
from toolgym.kit.warm_start import WarmStartConfig, warm_start
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import RolloutWorkerError, VLLMServerError
from trainer.launch.vllm_server import VLLMServer
from trainer.records import Rollout
from trainer.rollout.loop import AsyncRolloutLoop
from trainer.rollout.reconcile import reconcile_turns
from trainer.rollout.settings import RolloutSettings
from trainer.rollout.tool_runner import ToolRunner, tools_from_functions
from trainer.sync.weight_sync import WeightSynchronizer


class EchoEnv:
    """A second environment, to check routing."""

    def reset(self, **kwargs: Any) -> str:
        """Start; returns the prompt."""
        return "Say something."

    def echo(self, text: str) -> str:
        """Echo the text back.

        Args:
            text: What to echo.
        """
        return text

    def fail(self, message: str) -> str:
        """Raise.

        Args:
            message: The error message.
        """
        raise ValueError(message)


class BrokenEnv:
    """Every reset fails."""

    def reset(self, **kwargs: Any) -> str:
        """Always raises."""
        raise RuntimeError("the sandbox is down")

    def noop(self) -> str:
        """Do nothing."""
        return ""


def boom(x: int) -> int:
    """Raise.

    Args:
        x: Ignored.
    """
    raise ValueError("tool broke")


def zero_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Constant reward."""
    return [0.0] * len(completions)


def _warm_copy(tiny_model_dir: Path, folder: Path, **config: Any) -> Path:
    """A copy of the tiny model after a short warm start on counter transcripts (~30 s on one thread)."""
    target = folder / "model"
    shutil.copytree(tiny_model_dir, target)
    warm_start(target, WarmStartConfig(task="counter", steps_per_task=120, batch_size=16, **config))
    return target


def _serve(server: VLLMServer, model_dir: Path, restore: WeightSynchronizer) -> VLLMServer:
    """Put ``model_dir``'s weights on the shared server (``restore_served_weights`` puts them back)."""
    restore.sync(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters(), version=1)
    return server


@pytest.fixture(scope="module")
def warm_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after a short warm start on counter transcripts."""
    return _warm_copy(tiny_model_dir, tmp_path_factory.mktemp("warm"))


@pytest.fixture()
def warm_server(vllm_server: VLLMServer, warm_model_dir: Path,
                restore_served_weights: WeightSynchronizer) -> Iterator[VLLMServer]:
    """The shared server serving the warm-started weights (restored afterwards)."""
    yield _serve(vllm_server, warm_model_dir, restore_served_weights)


@pytest.fixture(scope="module")
def thinking_warm_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same warm start on transcripts whose turns open with an empty reasoning block."""
    return _warm_copy(tiny_model_dir, tmp_path_factory.mktemp("warm-thinking"), empty_think_prob=1.0)


@pytest.fixture()
def thinking_warm_server(vllm_server: VLLMServer, thinking_warm_model_dir: Path,
                         restore_served_weights: WeightSynchronizer) -> Iterator[VLLMServer]:
    """The shared server serving :func:`thinking_warm_model_dir`'s weights (restored afterwards)."""
    yield _serve(vllm_server, thinking_warm_model_dir, restore_served_weights)


def _loop(server: VLLMServer, model_dir: Path, tmp_path: Path, tokenizer: PreTrainedTokenizerBase | None = None,
          settings: dict[str, Any] | None = None, **kwargs: Any) -> AsyncRolloutLoop:
    """A loop on ``server`` (``settings``: RolloutSettings fields; ``kwargs``: the loop's other arguments)."""
    fields = {"max_completion_length": 48, "max_tool_calling_iterations": 6, **(settings or {})}
    return AsyncRolloutLoop(RolloutSettings.from_server(server.base_url, str(model_dir), **fields),
                            tokenizer or AutoTokenizer.from_pretrained(model_dir), **kwargs)


def _rollouts(loop: AsyncRolloutLoop, rows: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], Rollout, Any]]:
    """One rollout of each row, one at a time."""
    return asyncio.run(loop.evaluate(rows, samples_per_row=1, concurrency=1))


def _check_tool_rollout(rollout: Rollout, env_reward: Any) -> None:
    """Masks: generated tokens trained exactly once, tool results and template glue never."""
    assert rollout.tool_call_count >= 1 and len(rollout.turns) >= 2
    sequences, stats = reconcile_turns(rollout.turns)
    generated = sum(len(t.output_ids) for t in rollout.turns)
    assert sum(s.num_trained for s in sequences) == generated
    assert len(sequences) == 1 + stats.forks
    if stats.forks == 0:  # the tiny template is prefix-preserving: one sample holds the conversation
        (seq,) = sequences
        last = rollout.turns[-1]
        assert seq.input_ids == last.prompt_ids + last.output_ids
        for turn in rollout.turns:  # each turn's sampled tokens sit, trained, right after its prompt
            start = len(turn.prompt_ids)
            assert seq.input_ids[start:start + len(turn.output_ids)] == turn.output_ids
            assert all(seq.loss_mask[start:start + len(turn.output_ids)])
        for turn, following in zip(rollout.turns, rollout.turns[1:], strict=False):  # tool results and glue: context
            glue = slice(len(turn.prompt_ids) + len(turn.output_ids), len(following.prompt_ids))
            assert glue.stop > glue.start and not any(seq.loss_mask[glue])
        tool_messages = [m for m in rollout.completion if m["role"] == "tool"]
        assert len(tool_messages) == rollout.tool_call_count
    assert env_reward is not None and env_reward[1] in (0.0, 1.0)


def _pick_tool_rollout(results: list[Any], all_calls_ran: bool = False) -> tuple[Rollout, Any]:
    # A sampled call can be malformed JSON (its tool message is then the parse error): a test that
    # reads the tool results takes a rollout whose calls all ran.
    with_tools = [(r, e) for _, r, e in results if r.tool_call_count and len(r.turns) >= 2
                  and not (all_calls_ran and r.tool_failure_count)]
    assert with_tools, "the warm model should call the tool in at least one of the rollouts"
    return with_tools[0]


def test_local_environment_multi_turn_rollout(warm_server: VLLMServer, warm_model_dir: Path, tmp_path: Path) -> None:
    loop = _loop(warm_server, warm_model_dir, tmp_path, environment_factory=IncrementEnv)
    results = _rollouts(loop, [{"target": t} for t in (2, 3, 4, 5, 6, 1)])
    rollout, env_reward = _pick_tool_rollout(results, all_calls_ran=True)
    _check_tool_rollout(rollout, env_reward)
    # The tool results the model saw are the environment's real counter values.
    counters = [int(m["content"]) for m in rollout.completion if m["role"] == "tool"]
    assert counters == sorted(counters) and all(c > 0 for c in counters)


def test_a_conversation_past_max_model_len_ends_the_rollout_not_the_run(warm_server: VLLMServer,
                                                                      warm_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(warm_model_dir)
    env = IncrementEnv()
    first = [{"role": "user", "content": env.reset(target=3)}]
    first_len = len(tokenizer.apply_chat_template(first, tools=[get_json_schema(env.increment)],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
    settings = RolloutSettings.from_server(warm_server.base_url, str(warm_model_dir), max_completion_length=48)
    # Room for the first turn; the second prompt holds the first call and its result (over 8 tokens) as well.
    small = replace(settings, server=replace(settings.server, max_model_len=first_len + 48 + 8))
    loop = AsyncRolloutLoop(small, tokenizer, environment_factory=IncrementEnv)
    results = _rollouts(loop, [{"target": 3}] * 4)
    called = [r for _, r, _ in results if r.tool_call_count]
    assert called, "the warm model should call the tool in at least one of the rollouts"
    assert all(len(r.turns) == 1 and r.completion[-1]["role"] == "tool" for r in called)
    full = [num for _, name, num, _ in loop.records.take() if name == "rollout/context_full_frac"]
    assert len(full) == 4 and sum(full) == len(called)
    # A first turn that cannot fit is the configuration's error, not the rollout's.
    tiny = replace(settings, server=replace(settings.server, max_model_len=first_len + 8))
    with pytest.raises(VLLMServerError, match="maximum context length"):
        _rollouts(AsyncRolloutLoop(tiny, tokenizer, environment_factory=IncrementEnv), [{"target": 3}])


def test_remote_environment_multi_turn_rollout(warm_server: VLLMServer, warm_model_dir: Path, tmp_path: Path) -> None:
    specs = {"counter": EnvSpec.from_factory("counter", IncrementEnv)}
    with ServerThread(specs, ServerConfig(port=0)) as envserver:
        factory = remote_factory(envserver.url, "counter")
        loop = _loop(warm_server, warm_model_dir, tmp_path, environment_factory=factory)
        results = _rollouts(loop, [{"target": t} for t in (2, 3, 4, 5)])
        rollout, env_reward = _pick_tool_rollout(results)
        _check_tool_rollout(rollout, env_reward)
        assert len(envserver.table) == 0, "every session is closed after the rollouts"


def test_routing_shows_only_that_environments_tools(warm_server: VLLMServer, warm_model_dir: Path,
                                                    tmp_path: Path) -> None:
    loop = _loop(warm_server, warm_model_dir, tmp_path, environment_factory={"counter": IncrementEnv, "echo": EchoEnv})
    results = _rollouts(loop, [{"environment": "echo"}, {"environment": "counter", "target": 2}])
    tokenizer = loop.tokenizer
    echo_prompt = tokenizer.decode(results[0][1].turns[0].prompt_ids)
    counter_prompt = tokenizer.decode(results[1][1].turns[0].prompt_ids)
    assert '"name": "echo"' in echo_prompt and "increment" not in echo_prompt
    assert '"name": "increment"' in counter_prompt and '"echo"' not in counter_prompt
    with pytest.raises(KeyError, match="routes to environment 'chess'"):
        loop.envs.resolve({"environment": "chess"})


def test_tool_failures_and_unknown_tools_become_messages() -> None:
    runner = ToolRunner(tools_from_functions([boom]))

    async def go() -> list[Any]:
        return [await runner.run(c) for c in (
            {"name": "boom", "arguments": {"x": 1}},
            {"name": "nope", "arguments": {}},
            {"name": None, "arguments": None, "error": "invalid tool call JSON", "raw": "{"},
        )]

    failed, unknown, malformed = asyncio.run(go())
    assert failed.failed and not failed.unknown and failed.content == "Error: ValueError: tool broke"
    assert unknown.failed and unknown.unknown and "unknown tool 'nope'" in unknown.content and "boom" in unknown.content
    assert malformed.failed and malformed.content == "Error: invalid tool call JSON"


def test_remote_tool_errors_become_messages() -> None:
    specs = {"echo": EnvSpec.from_factory("echo", EchoEnv)}
    with ServerThread(specs, ServerConfig(port=0)) as envserver:
        env = remote_factory(envserver.url, "echo")()

        async def go() -> list[Any]:
            try:
                await env.reset()
                runner = ToolRunner(environment_tools(env))
                return [await runner.run(c) for c in (
                    {"name": "echo", "arguments": {"text": "hi"}},
                    {"name": "fail", "arguments": {"message": "bad input"}},
                    {"name": "echo", "arguments": {"text": 3}},
                )]
            finally:
                await env.aclose()

        ok, failed, wrong_type = asyncio.run(go())
    assert not ok.failed and ok.content == "hi"
    assert failed.failed and "ValueError: bad input" in failed.content and failed.content.startswith("Error: ")
    assert wrong_type.failed and wrong_type.content.startswith("Error: ")


def test_every_rollout_failing_stops_the_run_with_a_clear_message(vllm_server: VLLMServer, tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    config = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=vllm_server.base_url, max_steps=2,
                             num_generations=4, max_completion_length=8, report_to="none", use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 8})
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=zero_reward, args=config,
                               train_dataset=dataset, environment_factory=BrokenEnv)
    with pytest.raises(RolloutWorkerError, match=r"every rollout is failing.*BrokenEnv.reset raised RuntimeError: "
                                                 r"the sandbox is down"):
        trainer.train()


def test_training_template_keeps_a_reasoning_family_rollout_in_one_sample(
        thinking_warm_server: VLLMServer, thinking_warm_model_dir: Path, tmp_path: Path) -> None:
    # With enable_thinking=False a Qwen3-style stock template drops, on the next render, the empty
    # reasoning block its generation prompt added: every turn forks. The training template that
    # rollout_chat_template picks at start keeps the whole conversation in one sample.
    from tests.trainer.rollout.test_training_templates import QWEN3_STYLE_STOCK
    from trainer.rollout.chat_template import render_prompt_ids
    from trainer.rollout.training_templates import rollout_chat_template

    kw = {"enable_thinking": False}
    outcomes = {}
    for name in ("stock", "training"):
        tokenizer = AutoTokenizer.from_pretrained(thinking_warm_model_dir)
        tokenizer.chat_template = QWEN3_STYLE_STOCK
        schemas = [t.schema for t in environment_tools(IncrementEnv())]
        template = rollout_chat_template(tokenizer, schemas, **kw) if name == "training" else None
        assert (template is not None) == (name == "training")
        loop = _loop(thinking_warm_server, thinking_warm_model_dir, tmp_path, tokenizer,
                     {"chat_template": template, "chat_template_kwargs": kw}, environment_factory=IncrementEnv)
        results = _rollouts(loop, [{"target": t} for t in (2, 3, 4, 5)])
        rollout, _ = _pick_tool_rollout(results)
        prompt = next(p for p, r, _ in results if r is rollout)
        before_each_turn = [prompt + rollout.completion[:i] for i, m in enumerate(rollout.completion)
                            if m["role"] == "assistant"]
        for turn, messages in zip(rollout.turns, before_each_turn, strict=True):
            # The incremental renderer gave exactly the ids of a full render.
            assert turn.prompt_ids == render_prompt_ids(tokenizer, messages, schemas, template, **kw)
        outcomes[name] = reconcile_turns(rollout.turns)[1]
    assert outcomes["stock"].forks == outcomes["stock"].transitions > 0
    assert outcomes["training"].forks == 0 and outcomes["training"].transitions > 0

