"""``examples/openenv_training.py`` trains the tiny model against ``examples/openenv_counting.py``, served by
OpenEnv 0.10's own server (in the OpenEnv venv), through the session's real vLLM CPU server.

The random tiny model hardly ever calls a tool, so the test checks what every run shows: one step
trained, the environment's reward (the OpenEnv observation's) and both reward functions logged, the
one declaring ``environments`` included; and, without vLLM, that the example's environment works
as the example uses it.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from sdk import OpenEnvEnvironment, environment_tools
from tests.sdk.openenv_side import ROOT, openenv_servers
from trainer.launch.vllm_server import VLLMServer


@pytest.fixture(scope="module")
def openenv_url() -> Iterator[str]:
    """The example's OpenEnv server."""
    with openenv_servers([ROOT / "examples" / "openenv_counting.py"]) as (url,):
        yield url


def test_the_example_documents_its_commands() -> None:
    doc = importlib.import_module("examples.openenv_training").__doc__ or ""
    assert "python examples/openenv_training.py" in doc
    assert ".cache/openenv/venv/bin/python examples/openenv_counting.py" in doc


@pytest.mark.slow
def test_the_counting_environment_through_openenv_environment(openenv_url: str) -> None:
    async def episode() -> None:
        async with OpenEnvEnvironment(openenv_url) as env:
            assert await env.reset(target=2) == "Increment the counter to 2."
            assert [t.name for t in environment_tools(env)] == ["increment"]
            assert await env.call("increment", {"step": 2}) == "2"
            assert (await env.get_reward(), env.done) == (1.0, True)
            assert (await env.state())["step_count"] == 1

    asyncio.run(episode())


def test_training_against_the_openenv_server(openenv_url: str, vllm_server: VLLMServer, tiny_model_dir: Path,
                                             tmp_path: Path) -> None:
    trainer = importlib.import_module("examples.openenv_training").main([
        "--model", str(tiny_model_dir), "--vllm-url", vllm_server.base_url, "--openenv-url", openenv_url,
        "--max-steps", "1", "--output-dir", str(tmp_path / "out"), "--num-generations", "4",
        "--max-completion-length", "16",
    ])
    assert trainer.state.global_step == 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 1 and math.isfinite(losses[0])
    logged = {m.group(1) for h in trainer.state.log_history for key in h
              if (m := re.fullmatch(r"rewards/(.+)/mean", key))}
    assert {"OpenEnvEnvironment", "tool_steps", "brevity_reward"} <= logged
