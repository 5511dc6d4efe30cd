"""Every family through the real vLLM CPU server: a tiny model of the family, taught one two-call episode,
runs multi-turn rollouts whose calls the loop reads, answers and renders back in the family's format.

One server for the whole run: every family's tiny model has the same shapes (a vocabulary of
``VOCAB_SIZE`` tokens, the same layers), so each family's weights are pushed into that server in
turn with the trainer's own weight sync, as a training run pushes a new policy. Requests carry token
ids and each family's stop tokens (``stop_token_ids``), and the loop decodes with the family's own
tokenizer, so the served tokenizer matters only through its end-of-sequence token, which the server
stops at whatever the request says: the served copy's is moved to a token no family's turn writes.
Each model is the kit's tiny model of the family (``toolgym tiny-model --family NAME``) fine-tuned
for a few seconds on one transcript: count to 2 by calling ``increment(step=1)`` twice, then answer.
Sampled at a low temperature it replays the episode; what is tested is everything between: the
family's stop tokens ending the turns on the server, the decoded text parsed, the tool results
rendered in the family's layout.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from environments.counter import IncrementEnv
from toolgym.kit.tiny_model import VOCAB_SIZE, build_tiny_model
from toolgym.kit.warm_start import Transcript, WarmStartConfig, counter_tools, fine_tune
from trainer.families import Family, families
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.rollout.evaluation import evaluate_policy
from trainer.rollout.settings import RolloutSettings
from trainer.sync.push import push_weights

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


def _stop_at_an_unused_token(model_dir: Path) -> None:
    """Make the served copy's end-of-sequence token the vocabulary's last merge, which no family's turn writes."""
    last = VOCAB_SIZE - 1
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": last}))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = model_dir / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "eos_token": tokenizer.convert_ids_to_tokens(last)}))


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server for every family's weights in turn (module docstring)."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("served") / "model", seed=0, family=FAMILIES[0])
    _stop_at_an_unused_token(model_dir)
    with VLLMServer(VLLMServerConfig(model=str(model_dir), max_model_len=1024)) as server:
        yield server.base_url


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_a_two_call_rollout_through_the_real_server(server_url: str, family: Family, tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", seed=0, family=family)
    losses = fine_tune(model_dir, [two_calls()] * 4, WarmStartConfig(task="counter", steps_per_task=60, batch_size=4))
    assert losses[-1] < 0.05, losses[-5:]
    weights = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters()
    push_weights(server_url, weights, version=FAMILIES.index(family) + 1, model_dir=model_dir)
    settings = RolloutSettings.from_server(server_url, str(model_dir), temperature=0.05, max_completion_length=96,
                                           max_tool_calling_iterations=8)
    result = evaluate_policy(settings, IncrementEnv, rows=[{"target": 2}], samples_per_row=4)
    assert result.episodes == 4
    assert result.tool_calls_per_episode == 2.0 and result.failed_tool_call_frac == 0.0, (family.name, result)
    assert result.success_rate == 1.0, (family.name, result)
