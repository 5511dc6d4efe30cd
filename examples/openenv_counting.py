"""A counting environment written with OpenEnv 0.10, served by OpenEnv's own server.

The same task as ``environments.counter:IncrementEnv``: ``reset`` picks a target, the one MCP tool
``increment(step)`` adds to a counter, and each step's observation carries the reward (1.0 when the
counter equals the target) and ``done`` once the counter reaches or passes it. The tool is an
OpenEnv MCP tool (FastMCP), so OpenEnv's ``MCPToolClient`` and toolgym's ``OpenEnvEnvironment`` both
list it with its JSON schema.

Run it with the OpenEnv venv's python (``make setup`` makes ``.cache/openenv/venv``; OpenEnv 0.10
cannot share a venv with vLLM 0.32: ``docs/interop.md``)::

    .cache/openenv/venv/bin/python examples/openenv_counting.py --port 8770

``examples/openenv_training.py`` trains the tiny model against it.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State


class CountingObservation(Observation):
    """What ``reset`` returns: the task, as text (toolgym's ``OpenEnvEnvironment`` makes it the prompt)."""

    prompt: str = ""


class CountingEnvironment(MCPEnvironment):
    """Reach the target by calling ``increment``; the reward is counter == target."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, max_target: int = 6) -> None:
        mcp = FastMCP("counting")
        self.max_target = max_target
        self.counter = 0
        self.target = 0
        self._rng = random.Random()
        self._state = State(step_count=0)

        @mcp.tool()
        def increment(step: int) -> int:
            """Increment the internal counter.

            Args:
                step: Value to add to the counter.
            """
            self.counter += step
            return self.counter

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, target: int | None = None,
              **kwargs: Any) -> Observation:
        """Start an episode: the ``target`` column when given, else a sampled one."""
        if seed is not None:
            self._rng.seed(seed)
        self.counter = 0
        self.target = int(target) if target is not None else self._rng.randint(1, self.max_target)
        self._state = State(episode_id=episode_id, step_count=0)
        return CountingObservation(prompt=f"Increment the counter to {self.target}.", done=False, reward=0.0)

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        """Run the tool call, then score it: the reward and ``done`` travel on the observation."""
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            observation.reward = float(self.counter == self.target)
            observation.done = self.counter >= self.target
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        raise ValueError(f"unknown action {type(action).__name__}; call the increment tool")

    @property
    def state(self) -> State:
        """The episode's id and step count."""
        return self._state


def main() -> None:
    """Serve the environment on ``--host``/``--port``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8770)
    parser.add_argument("--max-sessions", type=int, default=64)
    args = parser.parse_args()
    app = create_app(CountingEnvironment, CallToolAction, CallToolObservation, env_name="counting",
                     max_concurrent_envs=args.max_sessions)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
