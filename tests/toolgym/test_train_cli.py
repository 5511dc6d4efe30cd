"""``toolgym train``: config file + flags, clear refusals, and a real run that writes its plots."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from toolgym.cli.train import main, parse_args
from toolgym.kit.counter_experiment import serve_policy
from toolgym.kit.warm_start import arithmetic_prompt
from trainer.exceptions import ConfigError
from trainer.launch.threads import trainer_threads_beside_vllm
from trainer.launch.vllm_server import VLLMServer
from trainer.reporting import PLOTTED, write_plots
from trainer.sync.weight_sync import WeightSynchronizer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_yaml(path: Path, values: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def test_config_file_is_parsed_and_flags_override_it(tmp_path: Path) -> None:
    config_file = _write_yaml(tmp_path / "run.yaml", {
        "model": "some/model", "dataset": "prompts.jsonl", "reward_funcs": ["trainer.rewards:accuracy_reward"],
        "launch_vllm": True, "learning_rate": 1e-5, "max_steps": 7, "num_generations": 4,
        "max_staleness": 0, "output_dir": str(tmp_path / "out"), "report_to": "none",
    })

    run, config = parse_args([str(config_file), "--max_steps", "3", "--temperature", "0.7",
                              "--reward_funcs", "my.module:other_reward"])

    assert run.model == "some/model" and run.dataset == "prompts.jsonl" and config.launch_vllm is True
    assert run.reward_funcs == ["trainer.rewards:accuracy_reward", "my.module:other_reward"]
    assert config.learning_rate == 1e-5 and config.num_generations == 4 and config.max_staleness == 0
    assert config.max_steps == 3 and config.temperature == 0.7  # the flags win over the file
    assert config.output_dir == str(tmp_path / "out")


def test_boolean_flag_without_value_and_default_output_dir(tmp_path: Path) -> None:
    _, config = parse_args(["--model", str(tmp_path / "tiny"), "--launch_envserver", "--max_steps", "2"])

    assert config.launch_envserver is True and config.launch_vllm is False
    assert config.output_dir == "tiny-AsyncGRPO"


@pytest.mark.parametrize(("values", "message"), [
    ({"model": "m", "learnig_rate": 1e-5}, r"unknown field 'learnig_rate' in .*run.yaml; did you mean 'learning_rate'"),
    ({"model": "m", "num_generation": 4},
     r"unknown field 'num_generation' in .*run.yaml; did you mean 'num_generations'"),
    ({"learning_rate": 1e-5}, r"model is required"),
])
def test_a_wrong_field_in_the_file_is_refused_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], values: dict[str, object], message: str
) -> None:
    config_file = _write_yaml(tmp_path / "run.yaml", values)

    with pytest.raises(ConfigError, match=message):
        parse_args([str(config_file)])
    assert main([str(config_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("toolgym train: ") and len(err.strip().splitlines()) == 1  # one line, no traceback


def test_a_wrong_flag_or_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown argument '--max_step'; did you mean 'max_steps'"):
        parse_args(["--model", "m", "--max_step", "3"])
    with pytest.raises(ConfigError, match=r"argument --max_steps.*expected one argument"):
        parse_args(["--model", "m", "--max_steps"])
    with pytest.raises(ConfigError, match=r"argument --learning_rate.*invalid float value: 'fast'"):
        parse_args(["--model", "m", "--learning_rate", "fast"])
    with pytest.raises(ConfigError, match=r"config file .*missing.yaml does not exist"):
        parse_args([str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match=r"must hold a mapping"):
        parse_args([str(_write_yaml(tmp_path / "list.yaml", ["model", "m"]))])  # type: ignore[arg-type]


def test_the_readme_flags_parse_to_their_field_types() -> None:
    # A boolean flag alone must not swallow the next flag, and "2e-4" is a float (YAML would keep a string).
    run, config = parse_args(["--model", "m", "--reward_funcs", "trainer.rewards:accuracy_reward",
                              "--learning_rate", "2e-4", "--use_cpu", "--report_to", "tensorboard",
                              "--max-completion-length", "24", "--mask_truncated_completions"])

    assert config.learning_rate == 2e-4 and isinstance(config.learning_rate, float)
    assert config.use_cpu is True and config.report_to == ["tensorboard"]
    assert config.max_completion_length == 24 and config.mask_truncated_completions is True  # dashes accepted
    assert run.reward_funcs == ["trainer.rewards:accuracy_reward"]


def test_help_shows_every_fields_declared_help(capsys: pytest.CaptureFixture[str]) -> None:
    import dataclasses

    from trainer.config import AsyncGRPOConfig

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(AsyncGRPOConfig):
        if f.init and f.metadata.get("help"):
            assert f"--{f.name}" in shown
            assert " ".join(f.metadata["help"].split())[:40].replace("%%", "%") in shown, f.name


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 1), (16, 8)])
def test_a_cpu_trainer_beside_vllm_takes_half_the_cores(cores: int, threads: int) -> None:
    assert trainer_threads_beside_vllm(cores) == threads


def test_write_plots_writes_one_non_empty_png_per_metric(tmp_path: Path) -> None:
    history = [{"step": s, "loss": 0.1, "reward": s / 10, "frac_zero_std_groups": 0.5,
                "completions/mean_length": 10.0 + s, "rollout/generated_tokens_per_s": 100.0 * s} for s in (1, 2, 3)]
    history.append({"step": 3, "train_runtime": 9.0})  # the summary entry has none of the metrics

    written = write_plots(history, tmp_path / "plots")

    assert sorted(p.name for p in written) == sorted(k.replace("/", "_") + ".png" for k in PLOTTED)
    for path in written:
        assert path.read_bytes().startswith(PNG_SIGNATURE) and path.stat().st_size > 1000


def test_train_from_a_config_file_on_the_real_stack_writes_plots(
    vllm_server: VLLMServer, warm_arithmetic_model_dir: Path, restore_served_weights: WeightSynchronizer,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    serve_policy(vllm_server.base_url, warm_arithmetic_model_dir)
    rows = [{"prompt": [{"role": "user", "content": arithmetic_prompt(a, b)}], "solution": str(a + b)}
            for a in range(6) for b in range(6)]
    dataset = tmp_path / "sums.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    config_file = _write_yaml(tmp_path / "run.yaml", {
        "model": str(warm_arithmetic_model_dir), "dataset": str(dataset),
        "reward_funcs": ["trainer.rewards:accuracy_reward"], "vllm_server_base_url": vllm_server.base_url,
        "output_dir": str(out), "max_steps": 2, "num_generations": 8, "max_completion_length": 24,
        "learning_rate": 2e-4, "use_cpu": True, "gradient_checkpointing": False, "save_strategy": "no",
        "report_to": "tensorboard",
    })

    assert main([str(config_file)]) == 0

    printed = capsys.readouterr().out
    plots = sorted((out / "plots").glob("*.png"))
    assert {p.stem for p in plots} >= {"reward", "frac_zero_std_groups", "completions_mean_length"}
    for path in plots:
        assert path.read_bytes().startswith(PNG_SIGNATURE) and path.stat().st_size > 1000
        assert f"plot: {path}" in printed
    assert list(out.rglob("events.out.tfevents.*")), "report_to=tensorboard writes event files offline"


def test_env_kwargs_bind_a_local_class_and_env_token_reaches_the_remote_factory(tmp_path: Path) -> None:
    from toolgym.cli.train import _environment_factory
    from trainer.launch.for_run import hosted_classes

    run, _ = parse_args(["--model", "m", "--environment", "counter", "--env_kwargs", '{"max_target": 2}'])
    assert _environment_factory(run)().max_target == 2
    assert hosted_classes(_environment_factory(run))["IncrementEnv"].kwargs == {"max_target": 2}  # --launch_envserver
    run, _ = parse_args(["--model", "m", "--environment", "http://127.0.0.1:9/IncrementEnv", "--env_token", "s3"])
    assert _environment_factory(run).token == "s3"


@pytest.mark.parametrize(("args", "message"), [
    (["--environment", "counter", "--env_kwargs", "{max_target: 2}"], "--env_kwargs must be a JSON object"),
    (["--environment", "counter", "--env_kwargs", "[2]"], "--env_kwargs must be a JSON object"),
    (["--environment", "counter", "--env_kwargs", '{"high": 100}'],
     r"IncrementEnv cannot be made with \{'high': 100\}: got an unexpected keyword argument 'high'; its "
     r"parameters: IncrementEnv\(max_target=6, seed=None\)"),
    (["--environment", "http://127.0.0.1:9/IncrementEnv", "--env_kwargs", '{"max_target": 2}'],
     "--env_kwargs cannot reach a remote environment"),
    (["--environment", "toolgym.kit.counter_experiment:counter_eval_rows", "--launch_envserver", "--max_steps", "1"],
     r"launch_envserver=True: environment_factory \(<function counter_eval_rows .*\) is not a class"),
])
def test_bad_env_kwargs_are_refused_at_start_naming_the_class(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["--model", "m", *args]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_help_leads_with_the_trainers_own_flags_in_groups() -> None:
    from toolgym.cli.flag_groups import GROUPS, INHERITED
    from toolgym.cli.train import RunArguments, build_parser
    from trainer.config import AsyncGRPOConfig

    placed = [name for names in GROUPS.values() for name in names]
    assert len(placed) == len(set(placed)), "a field is in two groups"
    own = set(AsyncGRPOConfig.__annotations__) | {f.name for f in dataclasses.fields(RunArguments)}
    assert not own - set(placed), f"fields with no group in toolgym/cli/flag_groups.py: {sorted(own - set(placed))}"
    known = {f.name for f in dataclasses.fields(AsyncGRPOConfig)} | {f.name for f in dataclasses.fields(RunArguments)}
    assert not set(placed) - known, "a group names a field that does not exist"
    text = build_parser().format_help()
    headings = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert headings == ["options", *GROUPS, INHERITED]
    assert text.index("--num_generations") < text.index("--max_staleness") < text.index(INHERITED)
    assert text.index(INHERITED) < text.index("--eval_strategy")
