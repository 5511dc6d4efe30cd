"""The benchmark's counter environment served by OpenEnv 0.10 (run with the OpenEnv venv's python).

    .cache/bench-openenv/venv/bin/python bench/envserver/openenv_counter.py --port 8766

Same logic as ``environments.counter.IncrementEnv``: reset samples a target, a step adds to the
counter, the reward is counter == target. One uvicorn worker, like our server.
"""

from __future__ import annotations

import argparse
import gc
import random
import weakref

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

_LIVE: weakref.WeakSet[CounterEnvironment] = weakref.WeakSet()


class CounterAction(Action):
    """Add ``step`` to the counter."""

    step: int


class CounterObservation(Observation):
    """The counter after the action."""

    counter: int = 0


class CounterEnvironment(Environment):
    """IncrementEnv in OpenEnv's shape."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        _LIVE.add(self)
        self._state = State(step_count=0)
        self.counter = 0
        self.target = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: object) -> CounterObservation:
        self.counter, self.target = 0, random.randint(1, 6)
        self._state = State(step_count=0)
        return CounterObservation(counter=0, done=False, reward=0.0)

    def step(self, action: CounterAction) -> CounterObservation:  # type: ignore[override]
        self.counter += action.step
        self._state.step_count += 1
        return CounterObservation(counter=self.counter, done=False, reward=float(self.counter == self.target))

    @property
    def state(self) -> State:
        return self._state


def main() -> None:
    """Serve the counter on ``--host``/``--port`` with room for 4,096 sessions."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()
    app = create_app(CounterEnvironment, CounterAction, CounterObservation, env_name="counter",
                     max_concurrent_envs=4096)

    def live_environments() -> dict[str, int]:
        gc.collect()
        return {"live": len(_LIVE)}

    app.add_api_route("/bench/live", live_environments)  # the leak check: environments still alive
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, backlog=4096)


if __name__ == "__main__":
    main()
