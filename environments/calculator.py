"""A calculator for arithmetic problems; the reward compares the submitted answer with the row's.

With a dataset, the row's ``answer`` column (and optionally ``question``) arrives in ``reset``;
without one the environment makes up a problem. The model computes with ``calculate`` and ends
with ``submit_answer``; answers match when equal as numbers (``"0.5"``, ``"1/2"``, ``"1,000"``).
"""

from __future__ import annotations

import ast
import fractions
import operator
import random
from collections.abc import Callable

from sdk.environment import Environment

_Number = int | float
_BINARY: dict[type[ast.operator], Callable[[_Number, _Number], _Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[_Number], _Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPONENT = 64
_MAX_EXPRESSION = 500


def evaluate(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely (numbers, + - * / // % **, parentheses)."""
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} too large (limit {_MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported syntax: {ast.unparse(node)!r}; use numbers and + - * / // % ** ( )")


def parse_number(text: str | float | int) -> fractions.Fraction | None:
    """The number written in ``text`` (``"1,000"``, ``"1/2"``, ``"-3.5"``), or ``None``."""
    try:
        return fractions.Fraction(str(text).strip().replace(",", "").rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None


class CalculatorEnv(Environment):
    """Arithmetic with a calculator tool; reward 1.0 when the submitted answer equals the expected one."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self.expected: fractions.Fraction | None = None
        self.submitted: str | None = None

    def reset(self, question: str | None = None, answer: str | float | None = None, seed: int | None = None,
              **kwargs: object) -> str | None:
        """Start a problem.

        Args:
            question: The problem text; ``None`` when the dataset's prompt column carries it.
            answer: The expected answer (a number or its text). When neither is given, a random
                problem is made up and returned as the prompt.
            seed: Reseeds the made-up problems first: the same seed gives the same problem.
            **kwargs: Other dataset columns, ignored.

        Returns:
            The prompt, or ``None`` when the row has an answer but no question.
        """
        if seed is not None:
            self._rng.seed(seed)
        self.submitted = None
        if answer is None:
            a, b, c = (self._rng.randint(2, 99) for _ in range(3))
            question = f"What is {a} * {b} + {c}?"
            answer = a * b + c
        self.expected = parse_number(answer)
        if self.expected is None:
            raise ValueError(f"the expected answer {answer!r} is not a number")
        if question is None:
            return None
        return f"{question}\nUse the calculate tool for arithmetic, then call submit_answer with the final number."

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(3 + 4) * 12".

        Returns:
            The value of the expression.
        """
        value = evaluate(expression)
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)

    def submit_answer(self, answer: str) -> str:
        """Submit the final answer; only the last submission counts.

        Args:
            answer: The final answer, as a number.

        Returns:
            A confirmation of what was recorded.
        """
        if parse_number(answer) is None:
            raise ValueError(f"{answer!r} is not a number; submit digits like 42 or 3.5")
        self.submitted = answer
        return f"Recorded answer {answer}."

    def get_reward(self) -> float:
        """1.0 when the last submitted answer equals the expected one as a number, else 0.0."""
        if self.submitted is None or self.expected is None:
            return 0.0
        return 1.0 if parse_number(self.submitted) == self.expected else 0.0
