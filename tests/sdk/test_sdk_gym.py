"""The Gymnasium bridge both ways."""

from __future__ import annotations

import json
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env

from environments import BUNDLED
from environments.gridworld import GridWorldEnv
from sdk import GymnasiumEnvironment, RemoteEnvironment, ToolEnv, register_environment

# Importing ``environments`` registers each bundled class as toolgym/<Class>-v0.
GYM_IDS = {name: f"toolgym/{spec.rpartition(':')[2]}-v0" for name, spec in BUNDLED.items()}


def call(name: str, **arguments: object) -> str:
    return json.dumps({"name": name, "arguments": arguments})


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_environments_are_registered(name):
    env = gymnasium.make(GYM_IDS[name])
    observation, info = env.reset(seed=0)
    assert isinstance(observation, str) and observation
    assert env.observation_space.contains(observation)
    assert info["tools"] and all(t["type"] == "function" for t in info["tools"])
    env.close()


def test_counter_episode_through_gymnasium():
    env = gymnasium.make("toolgym/IncrementEnv-v0")
    observation, _ = env.reset(options={"target": 3})
    assert observation == "Increment the counter to 3."
    assert env.step(call("increment", step=2)) == ("2", 0.0, False, False, {"tool": "increment", "error": False})
    observation, reward, terminated, truncated, info = env.step(call("increment", step="x"))
    assert info["error"] is True and observation.startswith("Error:")
    env.step(call("increment", step=1))
    assert env.step("I am done.") == ("", 1.0, True, False, {"answer": "I am done."})
    env.close()


def test_truncation_scores_the_episode():
    env_id = register_environment("environments.counter:IncrementEnv", name="ShortCounter", max_steps=2)
    env = gymnasium.make(env_id)
    env.reset(options={"target": 2})
    assert env.step(call("increment", step=1))[2:4] == (False, False)
    _, reward, terminated, truncated, _ = env.step(call("increment", step=1))
    assert (reward, terminated, truncated) == (1.0, False, True)


def test_unknown_tool_is_an_error_observation():
    env = ToolEnv("counter")
    env.reset()
    observation, _, _, _, info = env.step(call("jump"))
    assert info["error"] and "unknown tool 'jump'" in observation


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_gymnasium_env_checker_passes_every_bundled_environment(name):
    # Through gymnasium.make: check_env compares seeded resets only when the env has a spec.
    env = gymnasium.make(GYM_IDS[name]).unwrapped
    assert env.spec is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checker warning fails the test too
        gym_check_env(env)
    env.close()


# One tool call whose result depends on the episode's hidden state (the word, the target...).
PROBES = {
    "counter": call("increment", step=1),
    "wordle": call("guess", word="crane"),
    "calculator": call("submit_answer", answer="1"),
    "python": call("run_code", code="pass"),
    "gridworld": call("step", action="down"),
}


def test_every_bundled_environment_has_a_probe():
    assert set(PROBES) == set(BUNDLED)


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_same_seed_same_episode_and_other_seeds_differ(name):
    env = gymnasium.make(GYM_IDS[name])

    def episode(seed: int) -> tuple[str, str, float]:
        prompt, _ = env.reset(seed=seed)
        observation = env.step(PROBES[name])[0]
        return prompt, observation, env.step("done")[1]

    runs = {seed: episode(seed) for seed in range(8)}
    assert episode(3) == runs[3] and episode(0) == runs[0]
    if name != "gridworld":  # FrozenLake's fixed 4x4 map has one start state
        assert len(set(runs.values())) > 1, "every seed gave the same episode: the seed is ignored"
    env.close()


class NoSeed:
    def reset(self, target: int = 1) -> str:
        return "hi"


def test_an_environment_whose_reset_takes_no_seed_is_refused_clearly():
    env = ToolEnv(NoSeed)
    assert env.reset()[0] == "hi"
    with pytest.raises(TypeError, match="NoSeed.reset takes no 'seed' argument"):
        env.reset(seed=1)


def test_remote_environment_through_gymnasium(server):
    env = ToolEnv(lambda: RemoteEnvironment(server.url, "counter"))
    assert env.reset(options={"target": 1})[0] == "Increment the counter to 1."
    assert env.step(call("increment", step=1))[0] == "1"
    assert env.step("done")[1] == 1.0
    env.close()


def test_grid_world_is_a_gymnasium_text_env_as_toolgym_env():
    env = GridWorldEnv()
    prompt = env.reset(seed=0)
    assert "Actions: left, down, right, up." in prompt and "@FFF" in prompt
    for move in ("right", "right", "down", "down", "down"):
        env.step(move)
    last = env.step("right")
    assert "Game over." in last and "Reward: 1." in last
    assert env.get_reward() == 1.0
    with pytest.raises(RuntimeError, match="game is over"):
        env.step("left")


def test_grid_world_rejects_bad_actions_and_accepts_numbers():
    env = GridWorldEnv()
    env.reset()
    with pytest.raises(ValueError, match="choose one of: left, down, right, up"):
        env.step("jump")
    assert env.step("1").startswith("SFFF\n@HFH")  # 1 = down


def test_generic_bridge_takes_any_env_id():
    env = GymnasiumEnvironment("Blackjack-v1")
    assert "Actions: Discrete(2)" in env.reset(seed=3)
    assert "Reward:" in env.step("0")
