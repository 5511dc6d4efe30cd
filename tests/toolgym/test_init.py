"""``toolgym init NAME``: the scaffold's own test passes, ``toolgym serve`` hosts it, and a two-step
``toolgym train --config train.yaml`` on the tiny model runs on it (real env server, real vLLM server)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdk import RemoteEnvironment
from toolgym.cli.init import main, scaffold
from toolgym.kit.counter_experiment import serve_policy
from trainer.launch.envserver import EnvServerProcess
from trainer.launch.vllm_server import VLLMServer
from trainer.sync.weight_sync import WeightSynchronizer

REPO = Path(__file__).resolve().parents[2]
TOOLGYM = str(Path(sys.executable).with_name("toolgym"))


def _env(project: Path) -> dict[str, str]:
    """The scaffold used as a user would: toolgym importable from the venv, the project from its folder."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(project), str(REPO)])}


def test_init_writes_a_project_whose_own_tests_pass(tmp_path: Path) -> None:
    project = tmp_path / "my-counter"
    assert main([str(project)]) == 0
    names = sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())
    assert names == ["README.md", "my_counter/__init__.py", "my_counter/environment.py", "pyproject.toml",
                     "tests/test_environment.py", "train.yaml"]
    readme = (project / "README.md").read_text()
    for command in ("pytest", "toolgym serve my_counter.environment:MyCounterEnv",
                    "toolgym train --config train.yaml"):
        assert command in readme
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project,
                            env=_env(project), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


@pytest.mark.parametrize("name, message", [("1st-env", "does not make a Python package name"),
                                           ("class", "does not make a Python package name")])
def test_init_refuses_a_name_that_is_no_package(tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scaffold(tmp_path / name)


def test_init_never_overwrites_a_non_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "taken"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    assert main([str(project)]) == 2
    assert "already exists and is not empty: toolgym init never overwrites" in capsys.readouterr().err
    assert sorted(p.name for p in project.iterdir()) == ["notes.txt"]


@pytest.mark.vllm
def test_the_scaffold_is_served_and_trained_on(
    vllm_server: VLLMServer, warm_counter_model_dir: Path, restore_served_weights: WeightSynchronizer,
    tmp_path: Path,
) -> None:
    project = tmp_path / "my-counter"
    scaffold(project, model=str(warm_counter_model_dir))
    with EnvServerProcess(["my_counter.environment:MyCounterEnv"], cwd=str(project), env=_env(project),
                          quiet=True) as server:
        async def one_call() -> tuple[str | None, str]:
            env = RemoteEnvironment(server.url, "MyCounterEnv")
            try:
                prompt = await env.reset(target=2)
                return prompt, await env.call("increment", {"step": 2})
            finally:
                await env.aclose()
        assert asyncio.run(one_call()) == ("Increment the counter to 2.", "2")

    serve_policy(vllm_server.base_url, warm_counter_model_dir)
    result = subprocess.run(
        [TOOLGYM, "train", "--config", "train.yaml", "--launch_vllm", "false",
         "--vllm_server_base_url", vllm_server.base_url, "--max_steps", "2", "--num_generations", "4",
         "--max_completion_length", "48", "--use_cpu", "--report_to", "none", "--plots", "false",
         "--output_dir", str(tmp_path / "out")],
        cwd=project, env=_env(project), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
