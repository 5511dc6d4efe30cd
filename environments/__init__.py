"""Bundled environments, one module each, each usable in-process and on the env server.

Importing this package registers them, without importing any of them: each short name of ``BUNDLED``
(what ``toolgym serve counter`` accepts) with :func:`sdk.loading.register_name`, and each class with
Gymnasium as ``toolgym/<Class>-v0`` (:func:`sdk.gym.register_environment`), the way Gymnasium's own
``envs/__init__.py`` fills its registry. ``sdk`` never imports this package.
"""

from __future__ import annotations

from sdk.gym import register_environment
from sdk.loading import register_name

BUNDLED: dict[str, str] = {
    "counter": "environments.counter:IncrementEnv",
    "wordle": "environments.wordle:WordGuessEnv",
    "calculator": "environments.calculator:CalculatorEnv",
    "python": "environments.python_exec:PythonExecEnv",
    "gridworld": "environments.gridworld:GridWorldEnv",
}

for _name, _spec in BUNDLED.items():
    register_name(_name, _spec)
    register_environment(_spec)

__all__ = ["BUNDLED"]
