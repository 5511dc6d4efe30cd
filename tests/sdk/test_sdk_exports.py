"""Every public name of the sdk and envserver packages is exported, in a sorted ``__all__``."""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC_MODULES = {
    "sdk": ["sdk.checker", "sdk.environment", "sdk.exceptions", "sdk.factory", "sdk.gym", "sdk.loading", "sdk.remote",
            "sdk.sync", "sdk.tools"],
    "envserver": ["envserver.app", "envserver.config", "envserver.exceptions", "envserver.registry",
                  "envserver.server"],
}
NOT_EXPORTED = {"ProvidesTools", "class_tool_schemas", "health_body", "token_from_env", "ToolInfo", "did_you_mean"}


@pytest.mark.parametrize("package", list(PUBLIC_MODULES))
def test_all_is_sorted_and_resolves(package):
    module = importlib.import_module(package)
    assert module.__all__ == sorted(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None


@pytest.mark.parametrize("package", list(PUBLIC_MODULES))
def test_public_classes_and_functions_are_exported(package):
    exported = set(importlib.import_module(package).__all__)
    for module_name in PUBLIC_MODULES[package]:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            defined_here = getattr(value, "__module__", None) == module_name
            if name.startswith("_") or not defined_here or name in NOT_EXPORTED:
                continue
            if inspect.isclass(value) or inspect.isfunction(value):
                assert name in exported, f"{module_name}.{name} is public but not in {package}.__all__"


def test_every_sdk_error_derives_from_the_base():
    import sdk.exceptions as exc_module
    from sdk import ToolgymError

    errors = [v for v in vars(exc_module).values() if inspect.isclass(v) and issubclass(v, Exception)]
    assert all(issubclass(e, ToolgymError) for e in errors)
    tree = exc_module.__doc__ or ""
    assert all(e.__name__ in tree for e in errors), "the docstring tree lists every exception"
