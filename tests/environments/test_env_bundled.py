"""Every bundled environment passes check_env and plays a winning episode in-process and served."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from environments import BUNDLED
from envserver import ServerConfig, ServerThread, parse_specs
from sdk import RemoteEnvironment, check_env, load_target

FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"

# name -> (reset kwargs, tool calls that win the episode)
WINNING: dict[str, tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]] = {
    "counter": ({"target": 3}, [("increment", {"step": 2}), ("increment", {"step": 1})]),
    "wordle": ({"word": "crane"}, [("guess", {"word": "eerie"}), ("guess", {"word": "crane"})]),
    "calculator": ({"question": "What is 12 * 12 - 4?", "answer": "140"},
                   [("calculate", {"expression": "12 * 12 - 4"}), ("submit_answer", {"answer": "140"})]),
    "python": ({"tests": ["assert fib(10) == 55", "assert fib(0) == 0"], "task": "Write fib(n)."},
               [("run_code", {"code": FIB + "print(fib(10))"})]),
    "gridworld": ({"seed": 0}, [("step", {"action": a}) for a in ("right", "right", "down", "down", "down", "right")]),
}


def test_every_bundled_environment_has_a_winning_script():
    assert set(WINNING) == set(BUNDLED)


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_check_env_passes(name):
    check_env(load_target(name))


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_winning_episode_in_process(name):
    env = load_target(name)()
    kwargs, calls = WINNING[name]
    for episode in range(2):  # instances are reused across episodes
        assert env.reset(**kwargs) is None or isinstance(env.reset(**kwargs), str)
        for tool, arguments in calls:
            getattr(env, tool)(**arguments)
        assert env.get_reward() == 1.0, f"{name} episode {episode}"


@pytest.fixture(scope="module")
def bundled_server():
    srv = ServerThread(parse_specs(sorted(BUNDLED)), ServerConfig(port=0, drain_timeout=0.2)).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_winning_episode_served(bundled_server, name):
    kwargs, calls = WINNING[name]

    async def episode() -> float | None:
        async with RemoteEnvironment(bundled_server.url, name) as env:
            await env.reset(**kwargs)
            for tool, arguments in calls:
                await env.call(tool, arguments)
            return await env.get_reward()

    assert asyncio.run(episode()) == 1.0
