"""Python code execution: the model runs code in a sandbox; the reward is the share of tests passed.

With a dataset, the row's ``tests`` column (a list of ``assert`` statements, or one string of
them, one per line) arrives in ``reset``; without one the environment picks a built-in task. The
code graded is the last code that ``run_code`` ran without error, so the model can experiment and
then run its final solution. Each run is a fresh interpreter in an OS sandbox
(``environments.sandbox``); importing this module checks that the sandbox works here, or that
``TOOLGYM_SANDBOX=weak`` was chosen (which logs a warning), and raises
``IsolationUnavailableError`` otherwise. The reward comes from ``score_tests``: the tests run
outside the solution's process, so it cannot redefine what they call or print a score, and a
crash or early exit scores 0.
"""

from __future__ import annotations

import random
import signal

from environments.sandbox import (
    DEFAULT_LIMITS,
    Limits,
    RunResult,
    isolation,
    memory_ceiling,
    run_python,
    score_tests,
)
from sdk.environment import Environment

TASKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Write a function fib(n) that returns the n-th Fibonacci number, with fib(0) == 0 and fib(1) == 1.",
     ("assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(20) == 6765")),
    ("Write a function is_prime(n) that returns True when the integer n is a prime number.",
     ("assert is_prime(2)", "assert not is_prime(1)", "assert is_prime(97)", "assert not is_prime(91)")),
    ("Write a function reverse_words(s) that reverses the order of the words in the string s.",
     ("assert reverse_words('a b c') == 'c b a'", "assert reverse_words('hello') == 'hello'",
      "assert reverse_words('') == ''")),
    ("Write a function digit_sum(n) that returns the sum of the decimal digits of a non-negative integer.",
     ("assert digit_sum(0) == 0", "assert digit_sum(1234) == 10", "assert digit_sum(99999) == 45")),
)
isolation()  # at import, so that `toolgym serve python` refuses to start without a sandbox (or warns in weak mode)


def _describe(result: RunResult, limits: Limits) -> str:
    output = result.output or "(no output)"
    if result.timed_out:
        return f"{output}\n[killed: wall-clock limit of {limits.wall_seconds:g} s]"
    if result.out_of_memory:
        return f"{output}\n[killed: the run held more than its memory limit of {memory_ceiling(limits) >> 20} MiB]"
    if result.exit_code in (-signal.SIGKILL, -signal.SIGXCPU):
        return f"{output}\n[killed: CPU limit of {limits.cpu_seconds} s]"
    return output if result.exit_code == 0 else f"{output}\n[exit code {result.exit_code}]"


class PythonExecEnv(Environment):
    """Run Python in a sandbox to solve a task; reward = fraction of the row's tests passed."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS, seed: int | None = None) -> None:
        self.limits = limits
        self._rng = random.Random(seed)
        self.tests: list[str] = []
        self.solution: str | None = None

    def reset(self, tests: list[str] | str | None = None, task: str | None = None, seed: int | None = None,
              **kwargs: object) -> str | None:
        """Start a task.

        Args:
            tests: The row's tests: ``assert`` statements, as a list or one per line.
            task: The task text, when the row has it and no prompt column.
            seed: Reseeds the choice of built-in task first: the same seed gives the same task.
            **kwargs: Other dataset columns, ignored.

        Returns:
            The prompt (a built-in task when no tests are given), or ``None`` when the dataset's
            prompt column carries the task.
        """
        if seed is not None:
            self._rng.seed(seed)
        self.solution = None
        if tests is None:
            task, built_in = self._rng.choice(TASKS)
            tests = list(built_in)
        self.tests = tests.splitlines() if isinstance(tests, str) else list(tests)
        self.tests = [t for t in self.tests if t.strip()]
        if task is None:
            return None
        return f"{task}\nRun your code with the run_code tool; your last code that runs without error is graded."

    def run_code(self, code: str) -> str:
        """Run Python code in a fresh sandboxed interpreter and return what it printed.

        Args:
            code: A complete Python program; print what you want to see.

        Returns:
            The program's stdout and stderr (cut if long), and why it stopped if it failed.
        """
        result = run_python(code, self.limits)
        if result.ok:
            self.solution = code
        return _describe(result, self.limits)

    def get_reward(self) -> float:
        """The fraction of the tests that the last successful code passes (0.0 without one, or if it crashes)."""
        if self.solution is None:
            return 0.0
        return score_tests(self.solution, self.tests, self.limits)
