"""``accuracy_reward``: math-verify grading of the final answer; ``tool_error_penalty``: failed calls cost."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from environments.counter import IncrementEnv
from sdk import environment_tools
from trainer.rewards import TOOL_ERROR_PENALTY, accuracy_reward, tool_error_penalty
from trainer.rollout.chat_template import parse_tool_calls
from trainer.rollout.tool_runner import ToolRunner


def answer(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(("completion", "gold", "reward"), [
    (answer(r"The answer is \boxed{42}."), "42", 1.0),
    (answer(r"So x = \boxed{\frac{1}{2}}"), r"$\frac{1}{2}$", 1.0),
    (answer(r"\boxed{0.5}"), r"\frac{1}{2}", 1.0),                 # compared symbolically
    (answer(r"The answer is \boxed{41}."), "42", 0.0),
    (answer(r"\boxed{\frac{1}{3}}"), r"\frac{1}{2}", 0.0),
    (answer("I do not know."), "42", 0.0),                        # no answer at all
    (answer(""), "42", 0.0),
    (answer(r"\boxed{42}"), "not a number", None),                # gold does not parse: unscorable
    (answer(r"\boxed{42}"), "", None),
])
def test_accuracy_reward(completion, gold, reward):
    assert accuracy_reward(completions=[completion], solution=[gold]) == [reward]


def test_grades_the_last_assistant_message():
    completion = [
        {"role": "assistant", "content": r"Let me guess \boxed{1}", "tool_calls": []},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": r"Final: \boxed{7}"},
        {"role": "assistant", "content": ""},                         # empty message skipped
    ]
    assert accuracy_reward(completions=[completion], solution=["7"]) == [1.0]


def test_plain_string_completions_and_extra_columns():
    rewards = accuracy_reward(completions=[r"\boxed{3}", r"\boxed{4}"], solution=["3", "3"],
                              prompts=["p", "p"], completion_ids=[[1], [2]], difficulty=[1, 1])
    assert rewards == [1.0, 0.0]


def test_unparsable_gold_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="trainer.rewards"):
        assert accuracy_reward(completions=[answer(r"\boxed{1}")], solution=["???"]) == [None]
    assert "does not parse" in caplog.text


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="zip"):
        accuracy_reward(completions=[answer(r"\boxed{1}")] * 2, solution=["1"])


def test_works_from_worker_threads():
    completions = [answer(rf"\boxed{{{i}}}") for i in range(8)]
    golds = [str(i if i % 2 else i + 1) for i in range(8)]

    def grade(i: int) -> tuple[str, list[float | None]]:
        return threading.current_thread().name, accuracy_reward(completions=[completions[i]], solution=[golds[i]])

    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward") as pool:
        results = list(pool.map(grade, range(8)))
    assert all(name.startswith("reward") for name, _ in results)
    assert [r for _, (r,) in results] == [float(i % 2) for i in range(8)]


def _episode(*assistant_texts: str) -> list[dict[str, str]]:
    """A counter conversation: each assistant text's calls run by the trainer's real ToolRunner."""
    runner = ToolRunner(environment_tools(IncrementEnv()))
    messages: list[dict[str, str]] = []
    for text in assistant_texts:
        messages.append({"role": "assistant", "content": text})
        for call in parse_tool_calls(text)[1]:
            messages.append({"role": "tool", "content": asyncio.run(runner.run(call)).content})
    return messages


def test_tool_error_penalty_costs_a_rollout_with_a_failed_call():
    good = '<tool_call>\n{"name": "increment", "arguments": {"step": 3}}\n</tool_call>'
    completions = [
        _episode(good, "The counter is now 3."),
        _episode(good, '<tool_call>\n{"step": 5}}\n</tool_call>', "Done."),  # malformed JSON after the goal
        _episode('<tool_call>\n{"name": "decrement", "arguments": {"step": 1}}\n</tool_call>', "Done."),
        _episode('<tool_call>\n{"name": "increment", "arguments": {"steps": 1}}\n</tool_call>', "Done."),
        _episode("No tools needed."),
    ]
    assert tool_error_penalty(completions=completions) == [0.0, -TOOL_ERROR_PENALTY, -TOOL_ERROR_PENALTY,
                                                           -TOOL_ERROR_PENALTY, 0.0]
