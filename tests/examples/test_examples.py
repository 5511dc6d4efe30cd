"""Every script in ``examples/`` runs, so none of them rots.

Each example's ``main([...])`` trains on the tiny model against the session's vLLM server with tiny
settings (4 generations, 16 tokens per turn, one step; the curriculum runs until it skipped a
prompt), and the test checks what that run always shows: the step happened, the expected reward
names were logged (a group's metrics travel with it, so the step that receives it logs them), the
environment saw the row's columns, routing picked the row's environment, the curriculum skipped
solved prompts. The random tiny model almost never calls a tool, so no test relies on a call being
made. Fast checks of the examples' own functions (their doctests) come first.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import math
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from sdk.tools import environment_tools, tool_from_function
from tests.trainer.events import StopOnceLogged, StopWhen
from tests.trainer.rollout.test_scoring import STUB_TOKENIZER, stub_settings
from trainer.launch.vllm_server import VLLMServer
from trainer.metrics import MetricWindow
from trainer.rollout.chat_template import render_prompt_ids
from trainer.sync.weight_sync import WeightSynchronizer

EXAMPLES = ("custom_rewards", "multi_task_rewards", "tool_calling", "increment_env", "multi_environment", "curriculum")
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> ModuleType:
    # Imported as ``examples.<name>`` (the repository root is on sys.path), so the spawned rollout
    # worker can import the module too and unpickle its reward functions, tools and environments.
    return importlib.import_module(f"examples.{name}")


def _train(name: str, server: VLLMServer, model_dir: Path, tmp_path: Path, *extra: str, max_steps: int = 1,
           stop: Any = None) -> Any:
    """Run the example's ``main``; with ``stop`` (a callback of ``tests.trainer.events`` passed to the
    trainer), ``max_steps`` is only a cap and the run must have stopped on its event before it."""
    trainer = _example(name).main([
        "--model", str(model_dir), "--vllm-url", server.base_url, "--max-steps", str(max_steps),
        "--output-dir", str(tmp_path / "out"), "--num-generations", "4", "--max-completion-length", "16", *extra,
    ])
    steps = max_steps if stop is None else stop.stopped_at
    assert steps is not None and steps <= max_steps, "the run reached its step cap before the event it waits for"
    assert trainer.state.global_step == steps
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    return trainer


def _logged(trainer: Any) -> dict[str, list[float]]:
    """Every logged value by metric name, over the run's log history."""
    out: dict[str, list[float]] = {}
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            out.setdefault(key, []).append(value)
    return out


def _reward_names(logged: dict[str, list[float]]) -> set[str]:
    return {m.group(1) for key in logged if (m := re.fullmatch(r"rewards/(.+)/mean", key))}


# --------------------------------------------------------------------------- the scripts themselves


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_documents_its_command_and_parses_its_flags(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = _example(name)
    assert f"python examples/{name}.py" in (module.__doc__ or ""), "the docstring gives the exact command line"
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--model", "--vllm-url", "--max-steps", "--output-dir", "--num-generations",
                 "--max-completion-length"):
        assert flag in usage
    source = (EXAMPLES_DIR / f"{name}.py").read_text()
    assert 'if __name__ == "__main__":' in source, "the spawned rollout worker re-imports the script"


def test_custom_reward_functions_match_the_source_examples() -> None:
    ex = _example("custom_rewards")
    prompts = [[{"role": "user", "content": "The sky is"}], [{"role": "user", "content": "The sun is"}]]
    completions = [[{"role": "assistant", "content": " blue."}], [{"role": "assistant", "content": " in the sky."}]]
    assert ex.length_reward_func(prompts=prompts, completions=completions,
                                 completion_ids=[[6303, 13], [304, 279, 12884, 13]]) == [2.0, 4.0]
    formatted = [
        [{"role": "assistant", "content": "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think>"
                                         "<answer>(1 + 2) * 4 = 12</answer>"}],
        [{"role": "assistant",
          "content": "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."}],
    ]
    assert ex.format_reward_func(prompts=prompts, completions=formatted) == [1.0, 0.0]
    boxed = [[{"role": "assistant", "content": r"The solution is \boxed{2}."}],
             [{"role": "assistant", "content": r"The solution is \boxed{6}."}]]
    assert ex.ground_truth_reward_func(prompts=prompts, completions=boxed, ground_truth=["2", "5"]) == [1.0, 0.0]
    assert asyncio.run(ex.async_reward_func(prompts=prompts, completions=completions)) == [1.0, 1.0]
    dataset = ex.build_dataset()
    assert set(dataset.column_names) == {"prompt", "ground_truth"}


def test_task_rewards_return_none_for_the_other_task() -> None:
    ex = _example("multi_task_rewards")
    task = ["math", "code", "math"]
    answer = ["4", None, "12"]
    tests = [None, ["assert add(2, 3) == 5"], None]
    completions = [
        [{"role": "assistant", "content": "2 + 2 = 4"}],
        [{"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}],
        [{"role": "assistant", "content": "It is 11."}],
    ]
    kwargs = dict(prompts=[[]] * 3, completions=completions, task=task, answer=answer, tests=tests)
    assert ex.math_reward_func(**kwargs) == [1.0, None, -1.0]
    assert ex.coding_reward_func(**kwargs) == [None, 1.0, None]
    wrong = [[{"role": "assistant", "content": "def add(a, b):\n    return a - b"}]]
    assert ex.coding_reward_func(prompts=[[]], completions=wrong, task=["code"], tests=[tests[1]]) == [-1.0]
    exits_early = [[{"role": "assistant", "content": "import os\nos._exit(0)"}]]  # a reward hack
    assert ex.coding_reward_func(prompts=[[]], completions=exits_early, task=["code"], tests=[tests[1]]) == [-1.0]


def test_example_tools_and_environments_expose_the_right_tools() -> None:
    tools = _example("tool_calling")
    schemas = [tool_from_function(f) for f in (tools.multiply, tools.async_add)]
    assert [(t.name, t.is_async) for t in schemas] == [("multiply", False), ("async_add", True)]
    assert set(schemas[0].schema["function"]["parameters"]["properties"]) == {"a", "b"}

    envs = _example("multi_environment")
    coding, game = envs.CodingEnv(), envs.GameEnv()
    assert [t.name for t in environment_tools(coding)] == ["run_code"]
    assert [t.name for t in environment_tools(game)] == ["move"]
    game.reset(seed=3)
    assert game.get_reward() == 0.0
    (gx, gy), (x, y) = game.goal, game.position
    for action, count in (("right" if gx > x else "left", abs(gx - x)), ("down" if gy > y else "up", abs(gy - y))):
        for _ in range(count):
            game.move(action)
    assert game.get_reward() == 1.0
    coding.reset(seed=5)
    coding.run_code("for i in range(1, 21):\n    print(fib := round(1.618033988749895 ** i / 5 ** 0.5))")
    assert coding.get_reward() == 0.0, "printing every candidate answer is not solving the task"
    coding.reset(seed=5)
    coding.run_code(f"print({envs.fibonacci(coding.n)})")
    assert coding.get_reward() == 1.0

    counter = _example("increment_env")
    assert [t.name for t in environment_tools(counter.RecordingIncrementEnv("unused"))] == ["increment"]


def test_curriculum_pieces() -> None:
    ex = _example("curriculum")
    assert ex.CurriculumTrainer.loop_cls is ex.CurriculumRolloutLoop
    assert ex.CurriculumConfig(output_dir="unused", pass_rate_cap=0.5).pass_rate_cap == 0.5
    completions = [[{"role": "assistant", "content": "calm blue water"}], [{"role": "assistant", "content": "a b c d"}]]
    assert ex.word_budget_reward(completions=completions, limit=[4, 2]) == [1.0, -0.5]


def _group(row_index: int, rewards: list[float]) -> Any:
    from trainer.async_grpo_trainer import RolloutGroup

    n = len(rewards)
    return RolloutGroup(prompts=[[]] * n, reward_kwargs={}, completions=[[]] * n, completions_ids=[[]] * n,
                        completions_sequences=[[]] * n, tool_call_counts=[0] * n, tool_failure_counts=[0] * n,
                        policy_version=0, group_id=row_index, row_index=row_index, env_rewards=[None] * n,
                        rollout_rewards=[None] * n, rewards=np.array(rewards))


def test_curriculum_hooks_log_their_own_metrics(tmp_path: Path) -> None:
    # The hooks' log_metric / log_rate records are what the worker ships to the trainer's metric
    # window (rollout_loop._flush_metrics): reduced there with the built-in metrics' rules.
    ex = _example("curriculum")
    loop = ex.CurriculumRolloutLoop(stub_settings(), STUB_TOKENIZER, pass_rate_cap=0.75)
    try:
        asyncio.run(loop.setup())
        loop.compute_advantages(_group(0, [1.0, 1.0, 1.0, 1.0]))  # solved
        loop.compute_advantages(_group(1, [1.0, -0.5, -0.5, -0.5]))  # a quarter passes
        assert [loop.filter_prompt(i, {}, epoch=1) for i in (0, 1, 0)] == [False, True, False]
        window = MetricWindow()
        window.add_records(loop.records.take())
        logged = window.flush()
    finally:
        loop.executor.shutdown()
    assert logged["curriculum/skipped_count"] == 2.0, "a count is summed over the window"
    assert logged["curriculum/pass_rate"] == pytest.approx(0.625), "other values are averaged"
    assert logged["curriculum/solved_frac"] == 0.5, "a rate is sum of numerators / sum of denominators"


# --------------------------------------------------------------------------- the runs


def test_custom_rewards_run(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path,
                            restore_served_weights: WeightSynchronizer) -> None:
    trainer = _train("custom_rewards", vllm_server, tiny_model_dir, tmp_path)
    logged = _logged(trainer)
    names = {"length_reward_func", "format_reward_func", "ground_truth_reward_func", "async_reward_func"}
    assert names <= _reward_names(logged)
    assert set(logged["rewards/async_reward_func/mean"]) == {1.0}, "every completion is a non-empty conversation"
    assert all(0 < v <= 16 for v in logged["rewards/length_reward_func/mean"])


def test_multi_task_rewards_run(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path,
                                restore_served_weights: WeightSynchronizer) -> None:
    # The dataset holds three prompts of each task, so four trained groups hold both tasks; a group's
    # reward metrics are logged by the step that trains it at the latest.
    trainer = _train("multi_task_rewards", vllm_server, tiny_model_dir, tmp_path, max_steps=4)
    logged = _logged(trainer)
    # A task reward is logged only over the rows it scored (None rows are left out), so both names
    # appear, each within its own range.
    assert {"math_reward_func", "coding_reward_func", "brevity_reward"} <= _reward_names(logged)
    for name in ("math_reward_func", "coding_reward_func"):
        assert all(-1.0 <= v <= 1.0 for v in logged[f"rewards/{name}/mean"])
    assert all(-0.1 <= v <= 0.0 for v in logged["rewards/brevity_reward/mean"])


def test_tool_calling_run(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path,
                          restore_served_weights: WeightSynchronizer) -> None:
    trainer = _train("tool_calling", vllm_server, tiny_model_dir, tmp_path)
    assert [f.__name__ for f in trainer.tools] == ["multiply", "async_add"]
    logged = _logged(trainer)
    assert {"accuracy_reward", "brevity_reward"} <= _reward_names(logged)
    assert "tools/loop_exhausted_frac" in logged, "tool metrics are logged when the trainer has tools"
    assert "tools/call_frequency" in logged
    # The model is shown both tools: their schemas are in the rendered prompt.
    schemas = [tool_from_function(f).schema for f in trainer.tools]
    prompt = trainer.processing_class.decode(render_prompt_ids(
        trainer.processing_class, [{"role": "user", "content": "What is (2 + 3) * 4?"}], schemas))
    assert '"multiply"' in prompt and '"async_add"' in prompt


def test_increment_env_without_dataset_run(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path,
                                           restore_served_weights: WeightSynchronizer) -> None:
    trainer = _train("increment_env", vllm_server, tiny_model_dir, tmp_path)
    assert trainer.rollout_dataset is None, "the environment owns the data"
    logged = _logged(trainer)
    assert {"IncrementEnv", "brevity_reward"} <= _reward_names(logged)
    assert {"env/reset_s", "env/reward_s", "tools/loop_exhausted_frac"} <= set(logged)


def test_increment_env_with_dataset_run(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path,
                                        restore_served_weights: WeightSynchronizer) -> None:
    log = tmp_path / "episodes.jsonl"
    trainer = _train("increment_env", vllm_server, tiny_model_dir, tmp_path, "--with-dataset",
                     "--episode-log", str(log))
    assert {"RecordingIncrementEnv", "brevity_reward"} <= _reward_names(_logged(trainer))
    episodes = [json.loads(line) for line in log.read_text().splitlines()]
    assert episodes, "the environment logged its episodes"
    targets = set(trainer.rollout_dataset["target"])
    for episode in episodes:
        # reset got the row's columns but the prompt: the `target` column reached reset(target=...)
        assert set(episode["reset_kwargs"]) == {"target"}
        assert episode["reset_kwargs"]["target"] in targets
        assert episode["target"] == episode["reset_kwargs"]["target"]


def test_multi_environment_run(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path,
                               restore_served_weights: WeightSynchronizer, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "episodes.jsonl"

    def both_environments_ran() -> bool:  # the first group is one row's, so one environment's
        return log.exists() and {json.loads(line)["env"] for line in log.read_text().splitlines()} == {
            "CodingEnv", "GameEnv"}

    # How many groups ran by the end of step 1 depends on the machine's load: run until both had episodes.
    ex = _example("multi_environment")
    seen = StopWhen(both_environments_ran)
    monkeypatch.setattr(ex, "AsyncGRPOTrainer", functools.partial(ex.AsyncGRPOTrainer, callbacks=[seen]))
    trainer = _train("multi_environment", vllm_server, tiny_model_dir, tmp_path, "--episode-log", str(log),
                     max_steps=20, stop=seen)
    routes = dict(zip(trainer.rollout_dataset["seed"], trainer.rollout_dataset["environment"], strict=True))
    episodes = [json.loads(line) for line in log.read_text().splitlines()]
    expected_class = {"coding": "CodingEnv", "game": "GameEnv"}
    for episode in episodes:
        assert set(episode["reset_kwargs"]) == {"seed"}, "the `environment` column is not passed to reset"
        assert episode["env"] == expected_class[routes[episode["reset_kwargs"]["seed"]]], "routed by the row"
    assert {e["env"] for e in episodes} == {"CodingEnv", "GameEnv"}
    env_rewards = _reward_names(_logged(trainer)) - {"brevity_reward"}
    assert env_rewards and env_rewards <= {"CodingEnv", "GameEnv"}, "environment rewards are logged by class name"


def test_curriculum_run_skips_solved_prompts(vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path,
                                             restore_served_weights: WeightSynchronizer,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # 16 tokens are at most 16 words: every prompt with a budget of 16 words or more is solved by
    # every rollout (equal rewards: the group is dropped, yet compute_advantages records it), and the
    # next epoch skips it. How many steps the worker needs to reach that epoch depends on the
    # machine's load (2 steps were not enough beside a busy core), so the example's own main() runs
    # until the skip was logged: each step trains at least one of the 6 unsolved prompts of an
    # epoch of 12, so the second epoch starts within 7 steps; 30 is only the cap.
    ex = _example("curriculum")
    seen = StopOnceLogged("curriculum/skipped_count")
    monkeypatch.setattr(ex, "CurriculumTrainer", functools.partial(ex.CurriculumTrainer, callbacks=[seen]))
    trainer = _train("curriculum", vllm_server, tiny_model_dir, tmp_path, max_steps=30, stop=seen)
    logged = _logged(trainer)
    assert sum(logged.get("curriculum/skipped_count", [])) > 0, "the curriculum skipped solved prompts"
    # The loop's own metrics (log_metric / log_rate in the spawned worker) reached the trainer's logs.
    assert any(v > 0 for v in logged["curriculum/solved_frac"])
    assert all(0.0 <= v <= 1.0 for v in logged["curriculum/pass_rate"])
    assert "word_budget_reward" in _reward_names(logged)
