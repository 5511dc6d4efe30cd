"""``toolgym init NAME``: a new environment project, ready to test, serve and train.

Writes, into a new folder ``NAME`` (refused when it exists and is not empty)::

    NAME/
      README.md                  the three commands that matter: test, serve, train
      pyproject.toml             the package, and pytest's settings
      train.yaml                 a training config: toolgym train --config train.yaml
      PACKAGE/__init__.py
      PACKAGE/environment.py     the environment: one typed tool, reset, get_reward
      tests/test_environment.py  check_env, and one episode played by hand

``PACKAGE`` is ``NAME`` with dashes turned into underscores. The environment is the counter of the
README's walkthrough (reach a target with ``increment``), so the tiny model that ``make demo`` builds
trains on it as it is; replace its tool, ``reset`` and ``get_reward`` with your task's.

    toolgym init my-env [--model DIR]
"""

from __future__ import annotations

import argparse
import keyword
import sys
from pathlib import Path

_ENVIRONMENT = '''"""{title}: reach a target by incrementing a counter. Replace it with your task."""

from __future__ import annotations

import random

from sdk import Environment


class {cls}(Environment):
    """Reach the target by incrementing a counter.

    Every public method with type hints and a Google docstring is a tool the model can call; ``reset``
    starts an episode (dataset columns arrive as keyword arguments) and ``get_reward`` scores it.
    """

    def __init__(self) -> None:
        self.counter = self.target = 0
        self.rng = random.Random()

    def reset(self, target: int | None = None, seed: int | None = None, **kwargs: object) -> str:
        """Start an episode; returns the prompt the model sees."""
        if seed is not None:
            self.rng.seed(seed)
        self.counter = 0
        self.target = target if target is not None else self.rng.randint(1, 6)
        return f"Increment the counter to {{self.target}}."

    def get_reward(self) -> float:
        """1.0 when the counter ends on the target, else 0.0."""
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
'''

_TEST = '''"""The environment keeps toolgym's contract, and an episode played by hand scores as it should."""

from sdk import check_env
from {package}.environment import {cls}


def test_the_environment_passes_check_env() -> None:
    check_env({cls})


def test_an_episode_played_by_hand() -> None:
    env = {cls}()
    assert env.reset(target=3) == "Increment the counter to 3."
    env.increment(step=2)
    assert env.get_reward() == 0.0
    assert env.increment(step=1) == 3
    assert env.get_reward() == 1.0
'''

_TRAIN = '''# toolgym train --config train.yaml   (every field is also a flag, which overrides it: --max_steps 50)
model: {model}
environment: {package}.environment:{cls}
launch_vllm: true            # start a vLLM server on the model for the run, and stop it afterwards
output_dir: outputs/{package}
max_steps: 20
num_generations: 8
max_completion_length: 64
max_tool_calling_iterations: 4
learning_rate: 1.0e-5
save_strategy: "no"
'''

_README = '''# {name}

A toolgym environment: `{package}/environment.py` (class `{cls}`). Its public methods are the tools
the model calls; `reset` starts an episode and `get_reward` scores it.

```bash
pytest                                                  # check_env, and one episode by hand
toolgym serve {package}.environment:{cls} --port 8765   # host it on the env server
toolgym train --config train.yaml                       # train a model on it (set `model` in train.yaml)
```

A trainer elsewhere reaches the served environment as `--environment http://HOST:8765/{cls}`;
serving beyond this machine needs `--host 0.0.0.0 --token SECRET`.
'''

_PYPROJECT = '''[project]
name = "{name}"
version = "0.1.0"
description = "A toolgym environment."
requires-python = ">=3.11"

[tool.pytest.ini_options]
pythonpath = ["."]
testpaths = ["tests"]
'''


def _class_name(package: str) -> str:
    return "".join(part.capitalize() for part in package.split("_") if part) + "Env"


def scaffold(folder: Path, model: str = "PATH/TO/MODEL") -> list[Path]:
    """Write a new environment project into ``folder`` (see the module docstring).

    Args:
        folder: The project folder; created, or an empty one reused.
        model: The ``model`` written into ``train.yaml``.

    Returns:
        The files written.

    Raises:
        FileExistsError: ``folder`` exists and is not empty.
        ValueError: ``folder``'s name does not make a Python package name.
    """
    name = folder.name
    package = name.replace("-", "_")
    if not package.isidentifier() or keyword.iskeyword(package):
        raise ValueError(f"{name!r} does not make a Python package name (letters, digits, '_' or '-', not "
                         "starting with a digit)")
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} already exists and is not empty: toolgym init never overwrites; pick "
                              "another name or an empty folder")
    cls = _class_name(package)
    values = dict(name=name, package=package, cls=cls, model=model, title=cls)
    files = {
        "README.md": _README, "pyproject.toml": _PYPROJECT, "train.yaml": _TRAIN,
        f"{package}/__init__.py": f'"""The {name} environment."""\n\nfrom {package}.environment import {cls}\n\n'
                                  f'__all__ = ["{cls}"]\n',
        f"{package}/environment.py": _ENVIRONMENT, "tests/test_environment.py": _TEST,
    }
    written = []
    for relative, template in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**values))
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    """Run ``toolgym init``; returns the exit status (2 when the folder exists or the name is unusable)."""
    parser = argparse.ArgumentParser(prog="toolgym init", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the project folder to create (its package: dashes become underscores)")
    parser.add_argument("--model", default="PATH/TO/MODEL", help="the model train.yaml trains (a directory or id)")
    args = parser.parse_args(argv)
    try:
        written = scaffold(Path(args.name), args.model)
    except (FileExistsError, ValueError) as exc:
        print(f"toolgym init: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    print(f"\nnext: cd {args.name} && pytest")
    return 0
