"""``env_call_timeout``: a local environment's reset, tool or get_reward that hangs fails its rollout (a
counted failure; the scheduler discards the instance) instead of holding it forever."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sdk import environment_tools
from trainer.config import AsyncGRPOConfig
from trainer.exceptions import ConfigError, RolloutFailed
from trainer.metrics import RecordBuffer
from trainer.rollout.env_pool import environment_reward, reset_environment
from trainer.rollout.tool_runner import ToolRunner

RELEASE = threading.Event()  # lets the abandoned sync calls' threads finish at the end of the module


class HangingEnv:
    """Each of its calls hangs when asked to."""

    def __init__(self, hang: str) -> None:
        self.hang = hang

    def reset(self, **kwargs: object) -> str:
        """Start."""
        if self.hang == "reset":
            RELEASE.wait(30)
        return "Go."

    def get_reward(self) -> float:
        """Score."""
        if self.hang == "get_reward":
            RELEASE.wait(30)
        return 1.0

    def wait(self, seconds: int) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        RELEASE.wait(30)
        return "done"

    async def wait_async(self, seconds: int) -> str:
        """Wait, asynchronously.

        Args:
            seconds: How long.
        """
        await asyncio.sleep(3600)
        return "done"


@pytest.fixture(scope="module", autouse=True)
def _release_threads() -> object:
    yield
    RELEASE.set()


def _run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


@pytest.mark.parametrize("tool", ["wait", "wait_async"])
def test_a_hanging_tool_fails_the_rollout_at_the_timeout(tool: str) -> None:
    runner = ToolRunner(environment_tools(HangingEnv("")), ThreadPoolExecutor(2), timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(RolloutFailed, match=f"tool '{tool}' ran past env_call_timeout=0.3 s"):
        _run(runner.run({"name": tool, "arguments": {"seconds": 1}}))
    assert time.monotonic() - t0 < 5


def test_reset_and_get_reward_past_the_timeout_fail_the_rollout() -> None:
    executor = ThreadPoolExecutor(2)
    with pytest.raises(RolloutFailed, match=r"HangingEnv.reset ran past env_call_timeout=0.3 s"):
        _run(reset_environment(HangingEnv("reset"), {}, [], executor, RecordBuffer(), 0.3))
    with pytest.raises(RolloutFailed, match=r"HangingEnv.get_reward ran past env_call_timeout=0.3 s"):
        _run(environment_reward(HangingEnv("get_reward"), executor, RecordBuffer(), 0.3))
    # (the executor's two threads still run the abandoned calls: a fresh one for the call that returns)
    assert _run(environment_reward(HangingEnv(""), ThreadPoolExecutor(1), RecordBuffer(), 5)) == (HangingEnv, 1.0)


def test_the_timeout_is_a_checked_config_field(tmp_path: object) -> None:
    assert AsyncGRPOConfig(output_dir=str(tmp_path)).env_call_timeout == 120.0
    with pytest.raises(ConfigError, match="env_call_timeout=0 must be > 0"):
        AsyncGRPOConfig(output_dir=str(tmp_path), env_call_timeout=0)
