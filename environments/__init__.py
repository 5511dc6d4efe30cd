"""Bundled environments, one module each, each usable in-process and on the env server.

``BUNDLED`` maps the short names ``toolgym serve`` accepts to ``module:Class`` specs; importing this
package imports none of them.
"""

from __future__ import annotations

BUNDLED: dict[str, str] = {
    "counter": "environments.counter:IncrementEnv",
    "wordle": "environments.wordle:WordGuessEnv",
    "calculator": "environments.calculator:CalculatorEnv",
    "python": "environments.python_exec:PythonExecEnv",
    "gridworld": "environments.gridworld:GridWorldEnv",
}

__all__ = ["BUNDLED"]
