"""OpenEnv 0.10 servers for the interop tests; run with the OpenEnv venv's python (``tests/sdk/openenv_side.py``).

    .cache/openenv/venv/bin/python tests/sdk/openenv_servers.py --style action --port 8771
    .cache/openenv/venv/bin/python tests/sdk/openenv_servers.py --style mcp --port 8772 --max-sessions 1

``action``: the counter in OpenEnv's action style (``CounterAction(step)``; the observation carries the
counter, the reward counter == target and ``done`` at the target). ``mcp``: the counting environment
of ``examples/openenv_counting.py`` plus two tools that fail on demand, ``fail(message)`` (raises) and
``slow(seconds)`` (sleeps).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.openenv_counting import CountingEnvironment  # noqa: E402


class CounterAction(Action):
    """Add a value to the counter."""

    step: int = Field(description="Value to add to the counter.")


class CounterObservation(Observation):
    """The counter after the action, or the task after a reset."""

    counter: int = 0
    prompt: str = ""


class CounterEnvironment(Environment):
    """The counter, action style: ``step(CounterAction)``."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.counter = self.target = 0
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, target: int | None = None,
              **kwargs: Any) -> CounterObservation:
        self.counter, self.target = 0, int(target) if target is not None else random.randint(1, 6)
        self._state = State(episode_id=episode_id, step_count=0)
        return CounterObservation(prompt=f"Increment the counter to {self.target}.", reward=None)

    def step(self, action: CounterAction, timeout_s: float | None = None, **kwargs: Any) -> CounterObservation:  # type: ignore[override]
        if action.step == 13:
            raise RuntimeError("unlucky step")
        self.counter += action.step
        self._state.step_count += 1
        return CounterObservation(counter=self.counter, reward=float(self.counter == self.target),
                                  done=self.counter >= self.target)

    @property
    def state(self) -> State:
        return self._state


class FaultyCounting(CountingEnvironment):
    """The example's counting environment with tools that fail on demand."""

    def __init__(self) -> None:
        super().__init__()

        @self.tool()
        def fail(message: str) -> str:
            """Raise ValueError(message).

            Args:
                message: The error's message.
            """
            raise ValueError(message)

        @self.tool()
        async def slow(seconds: float) -> str:
            """Sleep, then answer.

            Args:
                seconds: How long to sleep.
            """
            await asyncio.sleep(seconds)
            return "slept"


def main() -> None:
    """Serve the chosen environment."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--style", choices=("action", "mcp"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-sessions", type=int, default=64)
    args = parser.parse_args()
    if args.style == "action":
        app = create_app(CounterEnvironment, CounterAction, CounterObservation, env_name="counter",
                         max_concurrent_envs=args.max_sessions)
    else:
        app = create_app(FaultyCounting, CallToolAction, CallToolObservation, env_name="counting",
                         max_concurrent_envs=args.max_sessions)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
