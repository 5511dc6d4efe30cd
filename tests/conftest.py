"""Shared fixtures: the tiny model (built once per test session) and one real vLLM CPU server.

Starting vLLM costs ~30 s, so one server serves the whole session. Tests that change its weights
restore the original ones before they return (see ``restore_served_weights``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from toolgym.kit.tiny_model import build_tiny_model
from trainer.launch.vllm_server import VLLMServer, VLLMServerConfig
from trainer.sync import weight_synchronizer
from trainer.sync.weight_sync import WeightSynchronizer

# The env server fixtures (``server``, test environments) for every test folder: helpers are modules
# imported as ``tests.<folder>.<module>``, fixtures come from here.
pytest_plugins = ["tests.envserver.servers"]

SERVER_MAX_MODEL_LEN = 1024

# The tests train the tiny model on this CPU while the vLLM CPU server generates beside it. Two torch
# threads against vLLM's busy cores made a 900-token forward/backward take 25 s; one takes under 1 s.
torch.set_num_threads(1)


VLLM_FIXTURES = {"vllm_server", "restore_served_weights", "two_vllm_servers"}
"""Fixtures that start (or need) the shared vLLM server: a test using one is marked ``vllm``."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs the vLLM server ``vllm``, so ``-m "not vllm"`` runs the fast suite."""
    for item in items:
        if VLLM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(autouse=True)
def _vllm_tests_are_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked ``vllm`` that starts a vLLM server fails, naming the missing mark."""
    if request.node.get_closest_marker("vllm") is None:
        def refuse(self: VLLMServer, *args: object, **kwargs: object) -> VLLMServer:
            raise AssertionError(f"{request.node.nodeid} starts a vLLM server: mark it @pytest.mark.vllm")

        monkeypatch.setattr(VLLMServer, "start", refuse)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly built tiny model directory (seed 0)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path) -> Iterator[VLLMServer]:
    """One real vLLM CPU server on the tiny model for the whole test session."""
    server = VLLMServer(VLLMServerConfig(model=str(tiny_model_dir), max_model_len=SERVER_MAX_MODEL_LEN))
    with server:
        yield server


@pytest.fixture(scope="session")
def two_vllm_servers(tiny_model_dir: Path) -> Iterator[list[VLLMServer]]:
    """Two more real vLLM CPU servers on the tiny model, started together once per test session, for the
    tests of several servers (``tests/trainer/vllm/test_several_servers.py``). A test that kills one puts a
    new one on the same port in the list before it returns; whatever the list holds is stopped at the end."""
    # Each engine on a core of its own: two vLLM CPU engines bound to the same cores (vLLM's default binds
    # each to all of them) spin against each other, and one ran 4x slower than the other here.
    cores = os.cpu_count() or 1
    servers = [VLLMServer(VLLMServerConfig(model=str(tiny_model_dir), max_model_len=SERVER_MAX_MODEL_LEN,
                                           extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)}))
               for i in range(2)]
    try:
        for server in servers:
            server.start(wait=False)  # both start at once: vLLM's start is most of the cost
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture()
def restore_served_weights(vllm_server: VLLMServer, tiny_model_dir: Path) -> Iterator[WeightSynchronizer]:
    """A weight synchroniser for the shared server; puts the checkpoint's weights back afterwards."""
    from transformers import AutoModelForCausalLM

    sync = weight_synchronizer(vllm_server.base_url, tiny_model_dir)
    yield sync
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sync.sync(original.named_parameters(), version=0)


@pytest.fixture(scope="session")
def warm_counter_model_dir() -> Path:
    """The tiny model warm-started on counter transcripts exactly as ``make demo`` builds it (seed 0).

    Built once per machine in the repository's ``.cache/`` (about two minutes of one CPU thread), the
    same folder ``make demo`` and the README walkthrough use, so the suite builds it once.
    """
    from toolgym.kit.counter_experiment import warm_model

    return warm_model(Path(__file__).resolve().parents[1] / ".cache", seed=0)


@pytest.fixture(scope="session")
def warm_arithmetic_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tiny model after a short warm start on the arithmetic task (answers in ``\\boxed{}``)."""
    import shutil

    from toolgym.kit.warm_start import WarmStartConfig, warm_start

    target = tmp_path_factory.mktemp("warm-arithmetic") / "model"
    shutil.copytree(tiny_model_dir, target)
    warm_start(target, WarmStartConfig(task="arithmetic", steps_per_task=150))
    return target
