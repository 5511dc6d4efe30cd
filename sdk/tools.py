"""Tool discovery: a function or an environment's public methods -> (name, JSON schema, callable).

The schema is exactly what ``transformers.utils.get_json_schema`` returns, so a chat template
renders a local method and the same method served remotely identically. Schemas of an environment
class are computed once per class and cached; ``environment_tools`` then only binds them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable
from unittest import mock

from sdk.environment import RESERVED_NAMES, Environment
from sdk.exceptions import (
    MissingDocstringError,
    UndocumentedArgumentError,
    UnsupportedTypeError,
)


@dataclasses.dataclass(frozen=True)
class Tool:
    """One tool the model can call.

    Attributes:
        name: The name the model calls it by (``schema["function"]["name"]``).
        schema: The OpenAI-style function schema, ``{"type": "function", "function": {...}}``.
        func: The callable; takes the arguments as keywords. Awaitable when ``is_async``.
        is_async: Whether ``func`` returns an awaitable (run it on the loop, not in a thread).
    """

    name: str
    schema: dict[str, Any]
    func: Callable[..., Any]
    is_async: bool


@runtime_checkable
class ProvidesTools(Protocol):
    """An object that lists its own tools (the remote client does: its tools live on the server)."""

    def __toolgym_tools__(self) -> list[Tool]:
        """The object's tools, bound to it."""
        ...


def tool_from_function(func: Callable[..., Any]) -> Tool:
    """Describe a function (or bound method) as a tool.

    Args:
        func: A sync or async function with type hints and a Google-style docstring.

    Returns:
        The tool, whose schema equals ``transformers.utils.get_json_schema(func)``.

    Raises:
        MissingDocstringError: ``func`` has no docstring.
        UndocumentedArgumentError: an argument is missing from the docstring's ``Args:`` section.
        UnsupportedTypeError: an argument lacks a type hint, has a type JSON schema cannot express,
            or is variadic (``*args`` / ``**kwargs``).
    """
    schema = _schema_of(func, getattr(func, "__qualname__", repr(func)))
    return Tool(schema["function"]["name"], schema, func, _is_async(func))


def environment_tools(env: object) -> list[Tool]:
    """The tools of an environment instance, bound to it, in definition order.

    For a local object these are its public methods minus the reserved hooks (``reset``,
    ``get_reward``, ``close``); for an object implementing ``__toolgym_tools__`` (such as
    ``sdk.RemoteEnvironment``) it is whatever that returns.

    Args:
        env: An environment instance.

    Returns:
        One ``Tool`` per tool, ``func`` bound to ``env``.

    Raises:
        ToolDefinitionError: a public method cannot be described (see ``tool_from_function``).
    """
    if isinstance(env, ProvidesTools):
        return env.__toolgym_tools__()
    env_class: type = type(env)  # as a plain ``type``: mypy checks ``type[object]`` against Hashable wrongly
    return [
        Tool(name, schema, getattr(env, name), is_async)
        for name, schema, is_async in class_tool_schemas(env_class)
    ]


@functools.cache
def class_tool_schemas(cls: type) -> tuple[tuple[str, dict[str, Any], bool], ...]:
    """``(name, schema, is_async)`` of every tool of an environment class, computed once per class.

    Raises:
        ToolDefinitionError: a public method cannot be described (see ``tool_from_function``).
    """
    sentinel = object()
    found = []
    for name, raw in _public_methods(cls):
        if isinstance(raw, (staticmethod, classmethod)):
            func = raw.__get__(sentinel, cls)
        else:
            func = types.MethodType(raw, sentinel)  # drops `self` exactly as a bound method would
        found.append((name, _schema_of(func, f"{cls.__qualname__}.{name}"), _is_async(func)))
    return tuple(found)


def _public_methods(cls: type) -> Iterator[tuple[str, Any]]:
    """Public functions defined on ``cls`` and its bases (not ``object``/``Environment``), in order."""
    seen: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, Environment):
            continue
        for name, value in vars(klass).items():
            if isinstance(value, (types.FunctionType, staticmethod, classmethod)):
                seen[name] = value
            else:
                seen.pop(name, None)  # a subclass may shadow a method with a plain attribute
    for name, value in seen.items():
        if not name.startswith("_") and name not in RESERVED_NAMES:
            yield name, value


_JSON_LEAVES = (int, float, str, bool, type(None), list, tuple, dict, Any, Ellipsis)
_JSON_ORIGINS = (list, tuple, dict, typing.Union, types.UnionType)


def _check_hint(hint: Any, where: str, param: str) -> None:
    """Refuse hints JSON cannot carry (``get_json_schema`` would silently call them "object")."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return
    if origin is None:
        if hint not in _JSON_LEAVES:
            raise UnsupportedTypeError(
                f"{where}: argument '{param}' has type {hint!r}, which a JSON tool call cannot carry; "
                "use int, float, str, bool, None, list[...], tuple[...], dict[str, ...] or Literal[...]"
            )
        return
    if origin not in _JSON_ORIGINS:
        raise UnsupportedTypeError(f"{where}: argument '{param}' has unsupported type {hint!r}")
    for arg in typing.get_args(hint):
        _check_hint(arg, where, param)


def _is_async(func: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(func)


def _schema_of(func: Callable[..., Any], where: str) -> dict[str, Any]:
    """``get_json_schema(func)``, with its failures turned into our typed errors naming ``where``."""
    # Imported here: transformers takes a second to import and most sdk users never build a schema.
    from transformers.utils import chat_template_utils as ctu

    if not inspect.getdoc(func):
        raise MissingDocstringError(
            f"{where} has no docstring: a tool needs a Google-style docstring describing what it "
            "does and an 'Args:' section describing each argument"
        )
    try:
        hints = typing.get_type_hints(func)
    except Exception as exc:  # an annotation naming something undefined
        raise UnsupportedTypeError(f"{where}: cannot resolve type hints: {exc}") from exc
    for param in inspect.signature(func).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise UnsupportedTypeError(
                f"{where} takes variadic argument '{param.name}'; a tool's arguments must be named "
                "and typed one by one"
            )
        if param.name not in hints:
            raise UnsupportedTypeError(f"{where}: argument '{param.name}' has no type hint")
        _check_hint(hints[param.name], where, param.name)
    try:
        if "torch" in sys.modules:
            return ctu.get_json_schema(func)
        # get_json_schema imports torch (3 s, 300 MB) only to map torch.Tensor, a type _check_hint
        # already refused; skip that import so the env server and clients start fast.
        with mock.patch.object(ctu, "is_torch_available", lambda: False):
            return ctu.get_json_schema(func)
    except ctu.TypeHintParsingException as exc:
        raise UnsupportedTypeError(f"{where}: {exc}") from exc
    except ctu.DocstringParsingException as exc:
        raise UndocumentedArgumentError(f"{where}: {exc}") from exc
