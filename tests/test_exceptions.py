"""Every public exception of every package sits in one tree: its package's root under ``ToolgymError``.

And each is drawn in its package's ``exceptions`` module docstring, so the documented tree is the real one.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from envserver.exceptions import EnvServerError
from sdk.exceptions import SDKError, ToolgymError
from trainer.exceptions import TrainerError

ROOTS: dict[str, type[ToolgymError] | None] = {
    "sdk": SDKError,
    "envserver": EnvServerError,
    "trainer": TrainerError,
    "environments": None,  # no errors of its own: a package that adds some gives it an exceptions module
    "toolgym": None,
}
# Modules that import heavy optional stacks only inside vLLM's process.
SKIP = {"trainer.sync.vllm_plugin", "toolgym.__main__"}


def _public_exceptions(package: str) -> list[type[BaseException]]:
    found = []
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if info.name in SKIP:
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__
                    and not name.startswith("_") and not any(part.startswith("_") for part in info.name.split("."))):
                found.append(obj)
    return found


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_every_public_exception_is_in_its_packages_tree(package: str) -> None:
    root = ROOTS[package]
    found = _public_exceptions(package)
    if root is None:
        assert not found, f"{package} defines {found}: give it an exceptions module with a root under ToolgymError"
        return
    documented = inspect.getdoc(importlib.import_module(f"{package}.exceptions")) or ""
    for exc in found:
        if exc is ToolgymError:
            continue
        assert issubclass(exc, root), f"{exc.__module__}.{exc.__qualname__} is not under {root.__name__}"
        assert issubclass(exc, ToolgymError)
        assert exc.__name__ in documented, f"{exc.__name__} is missing from {package}.exceptions' tree"


def test_package_roots_share_the_project_root() -> None:
    for root in filter(None, ROOTS.values()):
        assert root.__mro__[1] is ToolgymError, root
