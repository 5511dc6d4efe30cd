"""Find an environment class from a spec string: ``module:Attr`` or a registered short name.

Used by ``toolgym serve`` and by the Gymnasium registration; a miss says what exists ("did you
mean"). Short names live in a registry that packages of environments fill when imported
(``environments/__init__.py`` registers the bundled ones), so this module imports none of them.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import json
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

from sdk.exceptions import EnvironmentArgumentsError, SpecNotFoundError

_NAMES: dict[str, str] = {}


def register_name(name: str, spec: str) -> None:
    """Make ``load_target(name)`` resolve to ``spec`` (``module:Attr``), the way ``toolgym serve counter`` works.

    Args:
        name: The short name (``"counter"``).
        spec: What it stands for (``"environments.counter:IncrementEnv"``); imported only when loaded.
    """
    _NAMES[name] = spec


def registered_names() -> dict[str, str]:
    """Every short name registered so far, with its ``module:Attr`` spec."""
    return dict(_NAMES)


def load_target(target: str) -> Callable[[], object]:
    """Import ``module:Attr`` (dotted attributes allowed) or resolve a bundled short name.

    Args:
        target: ``"environments.counter:IncrementEnv"``, or a registered short name (``"counter"``
            once ``environments`` is imported).

    Returns:
        The attribute (usually an environment class).

    Raises:
        SpecNotFoundError: the module or attribute does not exist; close matches are suggested.
    """
    if ":" not in target:
        if target in _NAMES:
            return load_target(_NAMES[target])
        raise SpecNotFoundError(
            f"{target!r} is neither module:Class nor a registered environment name"
            + did_you_mean(target, _NAMES)
            + f" (registered: {', '.join(sorted(_NAMES)) or 'none'})"
        )
    module_name, _, attr_path = target.partition(":")
    obj: Any = _import_module(module_name)
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = [n for n, v in vars(obj).items() if not n.startswith("_") and inspect.isclass(v)]
            raise SpecNotFoundError(f"{module_name} has no attribute {attr_path!r}" + did_you_mean(part, names))
        obj = getattr(obj, part)
    return cast("Callable[[], object]", obj)


def parse_env_kwargs(text: str, flag: str = "--env_kwargs") -> dict[str, Any]:
    """The JSON object of a ``--env_kwargs`` flag.

    Raises:
        EnvironmentArgumentsError: ``text`` is not JSON, or not an object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EnvironmentArgumentsError(f"{flag} must be a JSON object, e.g. '{{\"high\": 100}}': {exc}") from None
    if not isinstance(value, dict):
        raise EnvironmentArgumentsError(f"{flag} must be a JSON object, e.g. '{{\"high\": 100}}'; got {text!r:.100}")
    return value


def with_arguments(factory: Callable[..., object], arguments: Mapping[str, Any]) -> Callable[[], object]:
    """``factory`` bound to constructor ``arguments``, checked against its signature now, not per episode.

    Raises:
        EnvironmentArgumentsError: naming the environment and the parameters it takes.
    """
    if not arguments:
        return factory
    name = getattr(factory, "__qualname__", repr(factory))
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return functools.partial(factory, **arguments)
    try:
        signature.bind(**arguments)
    except TypeError as exc:
        params = ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in signature.parameters.values())
        raise EnvironmentArgumentsError(f"{name} cannot be made with {dict(arguments)}: {exc}; its parameters: "
                                        f"{name}({params})") from None
    return functools.partial(factory, **arguments)


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest candidates, or ``""`` when none is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(m) for m in matches)}?" if matches else ""


def _import_module(module_name: str) -> Any:
    # A console script does not put the working directory on sys.path (``python -m`` does): add
    # it, so ``toolgym serve my_envs:MyEnv`` finds a module next to where it is run, as uvicorn does.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name and not module_name.startswith(f"{exc.name}."):
            raise  # the module exists but one of its own imports is missing: show that
        parent, _, leaf = module_name.rpartition(".")
        raise SpecNotFoundError(f"no module named {module_name!r}" + did_you_mean(leaf, _siblings(parent))) from exc


def _siblings(package: str) -> list[str]:
    """Modules next to the missing one: a package's submodules, or the top-level modules."""
    if not package:
        return [m.name for m in pkgutil.iter_modules()]
    try:
        path = importlib.import_module(package).__path__
    except (ImportError, AttributeError):
        return []
    return [m.name for m in pkgutil.iter_modules(path)]
