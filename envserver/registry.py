"""Which environment classes a server hosts, by name: ``NAME=module:Class`` specs -> ``EnvSpec``s.

A spec is ``module:Attr`` (named after the class), ``NAME=module:Attr``, or the short name of a
bundled environment (``counter``, ``wordle``, ...); ``sdk.loading`` finds the class.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from environments import BUNDLED
from envserver.exceptions import EnvSpecError
from envserver.validation import ArgumentValidator
from sdk import protocol
from sdk.exceptions import EnvironmentArgumentsError
from sdk.loading import load_target, with_arguments
from sdk.tools import class_tool_schemas


@dataclasses.dataclass(frozen=True)
class ToolInfo:
    """A hosted tool: its schema, whether it is async, and its argument validator."""

    schema: dict[str, Any]
    is_async: bool
    validate: ArgumentValidator


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """One environment class hosted under a name.

    Attributes:
        name: The name clients ask for (``/v1/ws/{name}``).
        factory: Zero-argument callable making one instance per session.
        tools: Tool name -> ``ToolInfo``, in definition order.
        has_reward: Whether instances define ``get_reward``.
        reset_is_async: Whether ``reset`` is a coroutine function (run on the loop, not in the pool).
        reward_is_async: Whether ``get_reward`` is a coroutine function.
    """

    name: str
    factory: Callable[[], object]
    tools: dict[str, ToolInfo]
    has_reward: bool
    reset_is_async: bool
    reward_is_async: bool

    @classmethod
    def from_factory(cls, name: str, factory: Callable[[], object]) -> EnvSpec:
        """Describe ``factory``'s environment; a class is inspected without being instantiated.

        Raises:
            EnvSpecError: ``factory`` is not callable or its environment has no ``reset``.
            ToolDefinitionError: a public method cannot be described as a tool.
        """
        if not callable(factory):
            raise EnvSpecError(f"environment {name!r}: {factory!r} is not a class or a callable")
        bound = factory.func if isinstance(factory, functools.partial) else factory  # constructor arguments
        env_cls = bound if isinstance(bound, type) else type(factory())
        if not callable(getattr(env_cls, "reset", None)):
            raise EnvSpecError(f"environment {name!r}: {env_cls.__qualname__} has no reset(**kwargs)")
        tools = {
            tool: ToolInfo(schema, is_async, ArgumentValidator(schema["function"]["parameters"]))
            for tool, schema, is_async in class_tool_schemas(env_cls)
        }
        get_reward = getattr(env_cls, "get_reward", None)
        reset = getattr(env_cls, "reset", None)  # checked above (to mypy env_cls is a bare type)
        return cls(
            name, factory, tools, callable(get_reward),
            inspect.iscoroutinefunction(reset), inspect.iscoroutinefunction(get_reward),
        )

    def describe(self) -> dict[str, Any]:
        """The JSON description served at ``/v1/envs`` and in ``hello``."""
        return {"tools": [info.schema for info in self.tools.values()], "has_reward": self.has_reward}

    @functools.cached_property
    def describe_json(self) -> str:
        """``describe()`` encoded once: every ``hello`` frame embeds it."""
        return protocol.dumps(self.describe())


def parse_specs(specs: Iterable[str], arguments: Mapping[str, Mapping[str, Any]] | None = None,
                ) -> dict[str, EnvSpec]:
    """Load ``[NAME=]module:Attr`` or bundled-name specs into a name -> ``EnvSpec`` table.

    Args:
        specs: The specs.
        arguments: Constructor arguments per hosted name (``toolgym serve --env_kwargs``).

    Raises:
        SpecNotFoundError: a spec names no importable module or attribute ("did you mean" included).
        EnvSpecError: two specs claim the same name, or a target is not an environment.
        EnvironmentArgumentsError: arguments for a name not hosted, or that its class does not take.
    """
    arguments = dict(arguments or {})
    table: dict[str, EnvSpec] = {}
    for spec in specs:
        name, _, target = spec.rpartition("=")
        factory = load_target(target)
        name = name or (target if target in BUNDLED else getattr(factory, "__name__", target))
        if name in table:
            raise EnvSpecError(f"two environments are named {name!r}; give one another name (NAME=module:Class)")
        kwargs = arguments.pop(name, {})
        if not isinstance(kwargs, Mapping):
            raise EnvironmentArgumentsError(f"--env_kwargs for {name!r} must be a JSON object; got {kwargs!r:.100}")
        table[name] = EnvSpec.from_factory(name, with_arguments(factory, kwargs))
    if not table:
        raise EnvSpecError("no environment given; pass module:Class or one of " + ", ".join(sorted(BUNDLED)))
    if arguments:
        raise EnvironmentArgumentsError(f"--env_kwargs names {sorted(arguments)}, which this server does not host "
                                        f"(it hosts {sorted(table)}): give arguments per hosted name")
    return table
