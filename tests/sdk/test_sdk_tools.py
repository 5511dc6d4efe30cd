"""Tool discovery: schemas equal get_json_schema, typed definition errors, reserved names."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from transformers.utils import get_json_schema

from environments.counter import IncrementEnv
from sdk import (
    Environment,
    MissingDocstringError,
    UndocumentedArgumentError,
    UnsupportedTypeError,
    environment_tools,
    tool_from_function,
)


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def search(query: str, limit: int | None = None, mode: Literal["fast", "deep"] = "fast",
                 weights: dict[str, float] | None = None, tags: list[str] | None = None) -> str:
    """Search the notes.

    Args:
        query: What to look for.
        limit: At most this many hits.
        mode: How hard to look.
        weights: Per-field weights.
        tags: Only notes with these tags.
    """
    return query


@pytest.mark.parametrize("func", [multiply, search])
def test_schema_equals_get_json_schema(func):
    tool = tool_from_function(func)
    assert tool.schema == get_json_schema(func)
    assert tool.name == func.__name__ and tool.func is func
    assert tool.is_async is asyncio.iscoroutinefunction(func)


class Shop(Environment):
    """Has tools, hooks, private helpers and non-method attributes."""

    currency = "EUR"

    def __init__(self) -> None:
        self.items: list[str] = []

    def reset(self, **kwargs: object) -> str:
        """Reset."""
        self.items = []
        return "shop"

    def get_reward(self) -> float:
        """Reward."""
        return float(len(self.items))

    def close(self) -> None:
        """Close."""

    def buy(self, item: str) -> str:
        """Buy an item.

        Args:
            item: The item's name.
        """
        self.items.append(item)
        return f"bought {item}"

    async def price(self, item: str) -> float:
        """Price of an item.

        Args:
            item: The item's name.
        """
        return 1.5

    @staticmethod
    def currencies() -> list[str]:
        """The accepted currencies."""
        return ["EUR"]

    def _secret(self) -> None:
        pass

    @property
    def total(self) -> int:
        return len(self.items)


def test_environment_tools_are_public_methods_in_definition_order():
    env = Shop()
    tools = environment_tools(env)
    assert [t.name for t in tools] == ["buy", "price", "currencies"]
    assert [t.is_async for t in tools] == [False, True, False]
    assert tools[0].schema == get_json_schema(env.buy)
    assert tools[0].func("tea") == "bought tea" and env.items == ["tea"]  # bound to the instance


def test_source_counter_tool_matches_the_source_schema():
    (tool,) = environment_tools(IncrementEnv())
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "increment",
            "description": "Increment the internal counter.",
            "parameters": {"type": "object", "properties": {"step": {"type": "integer", "description":
                           "Value to add to the counter."}}, "required": ["step"]},
            "return": {"type": "integer", "description": "The updated counter value."},
        },
    }


def test_subclass_can_hide_an_inherited_tool():
    class NoBuy(Shop):
        buy = None  # type: ignore[assignment]

    assert [t.name for t in environment_tools(NoBuy())] == ["price", "currencies"]


def no_doc(a: int) -> int:
    return a


def undocumented(a: int, b: int) -> int:
    """Adds.

    Args:
        a: The first.
    """
    return a + b


class Custom:
    pass


def custom_type(a: Custom) -> int:
    """Uses a class.

    Args:
        a: A custom object.
    """
    return 0


def set_type(a: set[int]) -> int:
    """Uses a set.

    Args:
        a: Numbers.
    """
    return 0


def no_hint(a) -> int:  # noqa: ANN001
    """No hint.

    Args:
        a: Anything.
    """
    return 0


def variadic(*names: str) -> int:
    """Variadic.

    Args:
        names: Names.
    """
    return 0


@pytest.mark.parametrize(("func", "error", "match"), [
    (no_doc, MissingDocstringError, "no_doc has no docstring"),
    (undocumented, UndocumentedArgumentError, "no description for the argument 'b'"),
    (custom_type, UnsupportedTypeError, "argument 'a' has type"),
    (set_type, UnsupportedTypeError, "unsupported type"),
    (no_hint, UnsupportedTypeError, "argument 'a' has no type hint"),
    (variadic, UnsupportedTypeError, "variadic argument 'names'"),
])
def test_definition_errors_are_typed(func, error, match):
    with pytest.raises(error, match=match):
        tool_from_function(func)


def test_environment_method_errors_name_the_class():
    class Broken:
        def reset(self, **kwargs: object) -> None:
            """Reset."""

        def act(self, x: int) -> int:
            return x

    with pytest.raises(MissingDocstringError, match="Broken.act has no docstring"):
        environment_tools(Broken())
