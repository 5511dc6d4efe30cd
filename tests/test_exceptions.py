"""Every public exception of every package sits in one tree: its package's root under ``ToolgymError``.

And each is drawn in its package's ``exceptions`` module docstring, so the documented tree is the real one.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from environments.sandbox.exceptions import SandboxError
from envserver.exceptions import EnvServerError
from sdk.exceptions import SDKError, ToolgymError
from trainer.exceptions import TrainerError

# package -> (its root error, the module whose docstring draws the tree); None: it defines no errors
ROOTS: dict[str, tuple[type[ToolgymError], str] | None] = {
    "sdk": (SDKError, "sdk.exceptions"),
    "envserver": (EnvServerError, "envserver.exceptions"),
    "trainer": (TrainerError, "trainer.exceptions"),
    "environments": (SandboxError, "environments.sandbox.exceptions"),  # the sandbox's are its only errors
    "toolgym": None,
}
# Modules that import heavy optional stacks only inside vLLM's process.
SKIP = {"trainer.sync.vllm_plugin", "toolgym.__main__"}


def _public_exceptions(package: str) -> list[type[BaseException]]:
    found = []
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if info.name in SKIP or info.name.rpartition(".")[2].startswith("_"):
            continue  # private modules (some are scripts run in a child process) hold no public errors
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__
                    and not name.startswith("_") and not any(part.startswith("_") for part in info.name.split("."))):
                found.append(obj)
    return found


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_every_public_exception_is_in_its_packages_tree(package: str) -> None:
    entry = ROOTS[package]
    found = _public_exceptions(package)
    if entry is None:
        assert not found, f"{package} defines {found}: give it an exceptions module with a root under ToolgymError"
        return
    root, tree_module = entry
    documented = inspect.getdoc(importlib.import_module(tree_module)) or ""
    for exc in found:
        if exc is ToolgymError:
            continue
        assert issubclass(exc, root), f"{exc.__module__}.{exc.__qualname__} is not under {root.__name__}"
        assert issubclass(exc, ToolgymError)
        assert exc.__name__ in documented, f"{exc.__name__} is missing from {package}.exceptions' tree"


def test_package_roots_share_the_project_root() -> None:
    for entry in filter(None, ROOTS.values()):
        assert entry[0].__mro__[1] is ToolgymError, entry
