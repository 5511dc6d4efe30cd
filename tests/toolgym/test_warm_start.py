"""Warm start: synthetic transcripts replay against the real environment; a few SFT steps lower the loss."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import get_json_schema

from environments.counter import IncrementEnv
from toolgym.cli.tiny_model import main
from toolgym.kit.tiny_model import build_tiny_model
from toolgym.kit.warm_start import (
    WarmStartConfig,
    evaluate,
    synthetic_transcripts,
    warm_start,
)
from trainer.rollout.chat_template import check_prefix_preserving
from trainer.training.tree_attention import TREE_ATTENTION

TINY_RUN = WarmStartConfig(task="all", seed=0, steps_per_task=3, batch_size=4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"task": "chess"}, "task must be one of"),
        ({"steps_per_task": 0}, "steps_per_task must be >= 1"),
        ({"max_target": 0}, "max_target must be >= 1"),
        ({"exact_step_prob": 1.5}, r"exact_step_prob must be in \[0, 1\]"),
        ({"digit_weight": 0.0}, "digit_weight must be > 0"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WarmStartConfig(**kwargs)  # type: ignore[arg-type]


def test_counter_transcripts_replay_against_the_real_environment() -> None:
    config = WarmStartConfig(task="counter", num_transcripts=300, restart_check_step=1)
    transcripts = synthetic_transcripts(config)
    assert all(t.tools == [get_json_schema(IncrementEnv().increment)] for t in transcripts)
    for transcript in transcripts:
        env = IncrementEnv()
        first, call, reply, final = transcript.messages  # one call, one answer
        assert first == {"role": "user", "content": env.reset(target=_target(first["content"]))}
        (tool_call,) = call["tool_calls"]
        assert tool_call["function"]["name"] == "increment"
        assert 1 <= tool_call["function"]["arguments"]["step"] <= env.max_target
        assert reply["role"] == "tool" and reply["name"] == "increment"  # the family's tool-result message
        assert reply["content"] == str(env.increment(**tool_call["function"]["arguments"]))
        assert final == {"role": "assistant", "content": f"The counter is now {env.counter}."}
        assert transcript.success == (env.get_reward() == 1.0)
    # An imperfect policy: RL has room to improve, yet the format is shown every time.
    # The first restart_check_step batches teach the exact step; then an imperfect policy: RL has
    # room to improve, yet the format is shown every time.
    assert all(t.success for t in transcripts[: config.batch_size])
    success = sum(t.success for t in transcripts) / len(transcripts)
    assert 0.4 < success < 0.6  # 0.4 + 0.6 / 6 expected


def _target(prompt: str) -> int:
    return int(prompt.rstrip(".").rsplit(" ", 1)[1])


def test_arithmetic_transcripts_box_a_sometimes_wrong_sum() -> None:
    config = WarmStartConfig(task="arithmetic", num_transcripts=400, arithmetic_error_rate=0.3)
    transcripts = synthetic_transcripts(config)
    for t in transcripts:
        assert t.tools is None and t.messages[1]["content"].startswith("The answer is \\boxed{")
    assert 0.6 < sum(t.success for t in transcripts) / len(transcripts) < 0.8


def test_transcripts_are_deterministic_and_alternate_tasks_by_batch() -> None:
    config = WarmStartConfig(task="all", num_transcripts=8, batch_size=4)
    transcripts = synthetic_transcripts(config)
    assert [t.messages for t in transcripts] == [t.messages for t in synthetic_transcripts(config)]
    kinds = ["counter" if t.tools else "arithmetic" for t in transcripts]
    assert kinds == ["counter"] * 4 + ["arithmetic"] * 4 + ["counter"] * 4 + ["arithmetic"] * 4


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_few_sft_steps_lower_the_loss_and_change_every_weight(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "a", seed=0)
    before = load_file(model_dir / "model.safetensors")
    result = warm_start(model_dir, TINY_RUN)
    assert len(result.losses) == TINY_RUN.max_steps
    assert sum(result.losses[-2:]) / 2 < result.losses[0]
    after = load_file(model_dir / "model.safetensors")
    unchanged = [name for name, tensor in before.items() if torch.equal(tensor, after[name])]
    assert unchanged == []
    # Still an ordinary loadable model (no trace of the tree attention used for training), with the
    # same tokenizer and template; deterministic given the seed.
    assert TREE_ATTENTION not in (model_dir / "config.json").read_text()
    assert AutoModelForCausalLM.from_pretrained(model_dir).config._attn_implementation != TREE_ATTENTION
    assert check_prefix_preserving(AutoTokenizer.from_pretrained(model_dir))
    again = build_tiny_model(tmp_path / "b", seed=0)
    warm_start(again, TINY_RUN)
    assert _digest(again / "model.safetensors") == _digest(model_dir / "model.safetensors")


def test_a_model_still_at_chance_at_the_check_restarts_from_a_fresh_initialisation(tmp_path: Path) -> None:
    config = WarmStartConfig(task="counter", seed=0, steps_per_task=4, batch_size=4, restart_check_step=2,
                             max_attempts=3)
    model_dir = build_tiny_model(tmp_path / "m", seed=0)
    result = warm_start(model_dir, config)
    # Two steps cannot teach the model to read the target: every check restarts, the last attempt
    # runs to the end and is kept.
    assert result.attempts == 3
    assert len(result.losses) == config.max_steps
    assert result.target_step_prob is not None and result.target_step_prob < 1.25 / config.max_target
    again = build_tiny_model(tmp_path / "again", seed=0)
    warm_start(again, config)
    assert _digest(again / "model.safetensors") == _digest(model_dir / "model.safetensors")


def test_digit_weight_teaches_the_step_faster(tmp_path: Path) -> None:
    # Same initialisation and transcripts (exact steps only); the weighted run puts more probability on
    # the step that reaches the target after the same few steps.
    probs = []
    for weight in (1.0, 10.0):
        model_dir = build_tiny_model(tmp_path / f"w{weight:g}", seed=0)
        config = WarmStartConfig(task="counter", seed=0, steps_per_task=24, batch_size=4, restart_check_step=100,
                                 digit_weight=weight)
        probs.append(warm_start(model_dir, config).target_step_prob)
    assert probs[0] is not None and probs[1] is not None
    assert probs[1] > 1.5 * probs[0]  # measured: 0.045 against 0.022


@pytest.mark.parametrize("task", ["counter", "arithmetic"])
def test_evaluate_scores_sampled_episodes(tmp_path: Path, task: str) -> None:
    model_dir = build_tiny_model(tmp_path / "m", seed=0)
    result = evaluate(model_dir, task, episodes=2, seed=0)
    assert result.task == task and result.episodes == 2
    assert 0.0 <= result.success_rate <= result.format_rate <= 1.0


def test_cli_rejects_an_unknown_warm_start_task(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main([str(tmp_path / "x"), "--warm-start", "chess"])
    assert excinfo.value.code == 2
    assert not (tmp_path / "x").exists()
