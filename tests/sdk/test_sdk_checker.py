"""check_env: the contract checks fail with a message that says what to fix."""

from __future__ import annotations

import pytest

from environments.counter import IncrementEnv
from sdk import EnvironmentCheckError, check_env


class NoKwargsReset:
    def reset(self) -> str:
        return "x"


class NeedsArgs:
    def __init__(self, size: int) -> None:
        self.size = size

    def reset(self, **kwargs: object) -> str:
        return "x"


class IntPrompt:
    def reset(self, **kwargs: object) -> int:
        return 3


class StrReward:
    def reset(self, **kwargs: object) -> None:
        return None

    def get_reward(self) -> str:
        return "1"


class NanReward(StrReward):
    def get_reward(self) -> float:  # type: ignore[override]
        return float("nan")


class RewardWithArgs(StrReward):
    def get_reward(self, completion: str) -> float:  # type: ignore[override]
        return 0.0


class BadTool:
    def reset(self, **kwargs: object) -> None:
        return None

    def act(self, x: int) -> int:
        return x


class AsyncEnv:
    """Async hooks and tools are awaited by the checker."""

    async def reset(self, **kwargs: object) -> str:
        return "go"

    async def get_reward(self) -> float:
        return 0.5

    async def act(self, x: int) -> int:
        """Act.

        Args:
            x: Amount.
        """
        return x


@pytest.mark.parametrize(("env", "match"), [
    (NoKwargsReset, r"reset must accept \*\*kwargs"),
    (NeedsArgs, r"NeedsArgs\(\) raised TypeError.*construct with no arguments"),
    (IntPrompt, "reset returned int; it must return str or None"),
    (StrReward, "get_reward returned str; it must return a float"),
    (NanReward, "rewards must be finite"),
    (RewardWithArgs, "get_reward must take no arguments, takes completion"),
    (BadTool, "a public method is not a valid tool: BadTool.act has no docstring"),
])
def test_broken_environments_are_reported(env, match):
    with pytest.raises(EnvironmentCheckError, match=match):
        check_env(env)


def test_unpicklable_class_is_reported():
    class Local(IncrementEnv):
        pass

    with pytest.raises(EnvironmentCheckError, match="does not pickle"):
        check_env(Local)


class NoTools:
    def reset(self, **kwargs: object) -> None:
        return None


def test_environment_without_tools_warns():
    with pytest.warns(UserWarning, match="exposes no tools"):
        check_env(NoTools)


def test_async_environment_and_instances_pass():
    check_env(AsyncEnv())
    check_env(IncrementEnv(max_target=3, seed=1), reset_kwargs={"target": 2})
