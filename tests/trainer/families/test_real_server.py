"""Every family through the real vLLM CPU server: a tiny model of the family, taught one two-call episode,
runs multi-turn rollouts whose calls the loop reads, answers and renders back in the family's format.

One server per family for the whole run (the module-scoped ``served`` fixture is parametrized, so
pytest runs each family's tests together). Each model is the kit's tiny model of the family
(``toolgym tiny-model --family NAME``) fine-tuned for a few seconds on one transcript: count to 2
by calling ``increment(step=1)`` twice, then answer. Sampled at a low temperature it replays the
episode; what is tested is everything between: the family's stop tokens ending the turns on the
server, the decoded text parsed, the tool results rendered in the family's layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from environments.counter import IncrementEnv
from toolgym.kit.tiny_model import build_tiny_model
from toolgym.kit.warm_start import Transcript, WarmStartConfig, counter_tools, fine_tune
from toolgym.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.families import Family, families
from trainer.rollout.evaluation import evaluate_policy
from trainer.rollout.settings import RolloutSettings

FAMILIES = [f for f in families() if f.training_template is not None][:8]


def two_calls() -> Transcript:
    """Count to 2 in two calls of ``increment(step=1)``, then say so."""
    env = IncrementEnv()
    messages: list[dict[str, Any]] = [{"role": "user", "content": env.reset(target=2)}]
    for i in range(2):
        call_id = f"functions.increment:{i}"
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": call_id, "function": {"name": "increment", "arguments": {"step": 1}}}]})
        messages.append({"role": "tool", "name": "increment", "tool_call_id": call_id,
                         "content": str(env.increment(1))})
    messages.append({"role": "assistant", "content": f"The counter is now {env.counter}."})
    return Transcript(messages, counter_tools(), success=True)


pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Family, Path, str]]:
    family: Family = request.param
    model_dir = build_tiny_model(tmp_path_factory.mktemp(family.name) / "model", seed=0, family=family)
    losses = fine_tune(model_dir, [two_calls()] * 4, WarmStartConfig(task="counter", steps_per_task=60, batch_size=4))
    assert losses[-1] < 0.05, losses[-5:]
    with VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024)) as server:
        yield family, model_dir, server.base_url


def test_a_two_call_rollout_through_the_real_server(served: tuple[Family, Path, str]) -> None:
    family, model_dir, base_url = served
    settings = RolloutSettings.from_server(base_url, str(model_dir), temperature=0.05, max_completion_length=96,
                                           max_tool_calling_iterations=8)
    result = evaluate_policy(settings, IncrementEnv, rows=[{"target": 2}], samples_per_row=4)
    assert result.episodes == 4
    assert result.tool_calls_per_episode == 2.0 and result.failed_tool_call_frac == 0.0, (family.name, result)
    assert result.success_rate == 1.0, (family.name, result)
