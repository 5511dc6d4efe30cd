"""Every public name of the sdk and envserver packages is exported, in a sorted ``__all__``."""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC_MODULES = {
    "sdk": ["sdk.checker", "sdk.environment", "sdk.exceptions", "sdk.factory", "sdk.gym", "sdk.loading",
            "sdk.mcp", "sdk.openenv", "sdk.remote", "sdk.sync", "sdk.tools"],
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



def test_trainer_lazy_names_resolve_and_match_the_type_checking_block():
    import ast

    import trainer

    assert trainer.__all__ == sorted(trainer.__all__)
    for name in trainer.__all__:
        value = getattr(trainer, name)
        assert value.__name__ == name
    tree = ast.parse(inspect.getsource(trainer))
    typed = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.If)
             for stmt in node.body if isinstance(stmt, ast.ImportFrom) for alias in stmt.names}
    assert typed == set(trainer.__all__), "the TYPE_CHECKING block imports exactly the lazy names"
