"""Rules of the counter, word game and calculator environments."""

from __future__ import annotations

import pytest

from environments.calculator import CalculatorEnv, evaluate
from environments.counter import IncrementEnv
from environments.wordle import WordGuessEnv, feedback


def test_counter_samples_targets_in_range_reproducibly():
    targets = [IncrementEnv(max_target=4, seed=7).reset() for _ in range(2)]
    assert targets[0] == targets[1]
    env = IncrementEnv(max_target=4, seed=1)
    assert {int(env.reset().split()[-1].rstrip(".")) for _ in range(50)} == {1, 2, 3, 4}


def test_counter_reward_needs_exact_target():
    env = IncrementEnv()
    env.reset(target="2", prompt="ignored column")
    env.increment(3)
    assert env.get_reward() == 0.0
    env.increment(-1)
    assert env.get_reward() == 1.0


@pytest.mark.parametrize(("guess", "secret", "marks"), [
    ("crane", "crane", "GGGGG"),
    ("lemon", "melon", "YGYGG"),
    ("eerie", "crane", "__Y_G"),  # a repeated letter is marked only as often as the secret has it
    ("speed", "abide", "__Y_Y"),  # the first unmatched e takes the only spare e
])
def test_wordle_feedback(guess, secret, marks):
    assert feedback(guess, secret) == marks


def test_wordle_game_flow():
    env = WordGuessEnv(max_guesses=2)
    env.reset(word="Stone")
    with pytest.raises(ValueError, match="exactly 5 letters"):
        env.guess("rock")
    assert env.guess("tones") == "TONES YYYYY: 1 guesses left."
    assert env.guess("notes").endswith("no guesses left; the word was STONE.")
    assert env.get_reward() == 0.0
    with pytest.raises(RuntimeError, match="game is over"):
        env.guess("stone")
    env.reset(word="stone")
    assert env.guess("stone") == "STONE GGGGG: solved in 1 guesses!"
    assert env.get_reward() == 1.0
    with pytest.raises(ValueError, match="must be 5 letters"):
        env.reset(word="abc")


@pytest.mark.parametrize(("expression", "value"), [("2**10", 1024), ("(3 + 4) * 12", 84), ("7 / 2", 3.5),
                                                    ("-3 ^ 2", -9), ("17 // 5 + 17 % 5", 5)])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(("expression", "error", "match"), [
    ("__import__('os')", ValueError, "unsupported syntax"),
    ("9 ** 999", ValueError, "exponent 999 too large"),
    ("1 / 0", ZeroDivisionError, "division by zero"),
    ("2 +", ValueError, "not an arithmetic expression"),
    ("1" * 600, ValueError, "longer than"),
])
def test_calculator_refuses_unsafe_or_bad_expressions(expression, error, match):
    with pytest.raises(error, match=match):
        evaluate(expression)


@pytest.mark.parametrize(("expected", "submitted", "reward"), [
    ("1,000", "1000", 1.0), ("0.5", "1/2", 1.0), (140, "140.", 1.0), ("3", "4", 0.0),
])
def test_calculator_reward_compares_numbers(expected, submitted, reward):
    env = CalculatorEnv()
    assert env.reset(answer=expected) is None  # the dataset's prompt column carries the question
    assert env.get_reward() == 0.0
    env.submit_answer(submitted)
    assert env.get_reward() == reward


def test_calculator_makes_up_problems_and_rejects_non_numbers():
    env = CalculatorEnv(seed=3)
    prompt = env.reset()
    assert prompt is not None and prompt.startswith("What is ")
    expression = prompt.removeprefix("What is ").split("?")[0]
    env.submit_answer(env.calculate(expression))
    assert env.get_reward() == 1.0
    with pytest.raises(ValueError, match="not a number"):
        env.submit_answer("forty")
