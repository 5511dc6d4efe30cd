"""Every TRL GRPOConfig name this trainer lacks is refused with why and what instead: the same
ConfigError from Python, from a YAML file and from a ``toolgym train`` flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from toolgym.cli.train import main, parse_args
from trainer.config import AsyncGRPOConfig
from trainer.exceptions import ConfigError
from trainer.trl_fields import TRL_ONLY_FIELDS

NAMES = sorted(TRL_ONLY_FIELDS)


def test_the_names_a_trl_user_tries_first_are_listed() -> None:
    assert {"beta", "loss_type", "scale_rewards", "num_iterations", "use_vllm", "vllm_mode", "max_prompt_length",
            "steps_per_generation", "generation_batch_size"} <= set(NAMES)
    assert not set(NAMES) & {f for f in AsyncGRPOConfig.__dataclass_fields__}, "a listed name became a real field"


@pytest.mark.parametrize("name", NAMES)
def test_python_refuses_it_with_the_reason(name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^{name} is a TRL GRPOConfig field that this trainer does not have: "):
        AsyncGRPOConfig(output_dir=str(tmp_path), **{name: 1})


@pytest.mark.parametrize("name", NAMES)
def test_the_command_line_refuses_it_with_the_same_text(name: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as from_python:
        AsyncGRPOConfig(output_dir=str(tmp_path), **{name: 1})
    assert main(["--model", "m", f"--{name}", "1"]) == 2
    assert f"toolgym train: {from_python.value}" in capsys.readouterr().err
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({"model": "m", name: 1}))
    with pytest.raises(ConfigError, match=f"^{name} is a TRL GRPOConfig field"):
        parse_args(["--config", str(config_file)])
