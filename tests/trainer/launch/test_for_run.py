"""``launch_vllm`` / ``launch_envserver`` and the progress display: the same run from Python as from ``toolgym train``.

The fast tests check what is refused at construction and what the trainer adds to its callbacks; the
``vllm`` one runs a newcomer's script (``python script.py``, its environment class defined in the script)
that launches both servers, trains, is interrupted in a second run, and leaves no server behind.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from datasets import Dataset
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_callback import ProgressCallback as TqdmCallback

from environments.counter import IncrementEnv
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.exceptions import ConfigError
from trainer.launch.for_run import check_launches, hosted_classes
from trainer.reporting import PlotCallback, ProgressCallback

ROOT = Path(__file__).resolve().parents[3]


def _config(tmp_path: Path, **overrides: Any) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                           gradient_checkpointing=False, max_steps=1, **overrides)


def _a_function_factory() -> IncrementEnv:
    return IncrementEnv()


def _local_class() -> type:
    class Local(IncrementEnv):
        pass
    return Local


def test_a_module_class_is_hosted_by_name_with_its_import_root_and_partial_arguments() -> None:
    hosted = hosted_classes(functools.partial(IncrementEnv, max_target=2))

    assert list(hosted) == ["IncrementEnv"]
    assert hosted["IncrementEnv"].spec == "environments.counter:IncrementEnv"
    assert hosted["IncrementEnv"].kwargs == {"max_target": 2}
    assert hosted["IncrementEnv"].import_root == str(ROOT)
    assert list(hosted_classes({"a": IncrementEnv, "b": IncrementEnv})) == ["a", "b"]


@pytest.mark.parametrize(("factory", "message"), [
    (lambda: IncrementEnv(),
     r"launch_envserver=True: environment_factory \(<function .*<lambda>.*\) is not a class.*give its class"),
    (_a_function_factory, r"is not a class \(a function, lambda or instance\)"),
    (IncrementEnv(), r"is not a class \(a function, lambda or instance\)"),
    (functools.partial(IncrementEnv, 2), r"binds positional arguments \(2,\), which cannot reach the env server"),
    (functools.partial(IncrementEnv, max_target=object()), r"keyword arguments must be JSON to reach the env server"),
    (_local_class(), r"Local, defined inside a function\) cannot be imported: define it at module level"),
    ({"counter": lambda: IncrementEnv()}, r"environment_factory\['counter'\] .* is not a class"),
    (None, r"launch_envserver=True needs an environment_factory to host"),
])
def test_a_factory_an_env_server_cannot_import_is_refused_at_construction(
    tmp_path: Path, factory: Any, message: str
) -> None:
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}], "environment": "counter"}])
    with pytest.raises(ConfigError, match=message):  # refused before the model is loaded: no such model exists
        AsyncGRPOTrainer(model=str(tmp_path / "no-model"), environment_factory=factory, train_dataset=rows,
                         args=_config(tmp_path, launch_envserver=True))


def test_launches_are_refused_under_several_processes() -> None:
    args = SimpleNamespace(launch_vllm=True, launch_envserver=False, world_size=2)
    with pytest.raises(ConfigError, match=r"start servers for one training process, and this run has 2"):
        check_launches(args, None)  # type: ignore[arg-type]  # the fields it reads


def test_a_class_of_the_script_run_as_main_is_imported_from_the_scripts_file(tmp_path: Path) -> None:
    script = tmp_path / "my_script.py"
    script.write_text(textwrap.dedent("""
        import json
        from environments.counter import IncrementEnv
        from trainer.launch.for_run import hosted_classes

        class ScriptEnv(IncrementEnv):
            pass

        if __name__ == "__main__":
            hosted = hosted_classes(ScriptEnv)["ScriptEnv"]
            print(json.dumps([hosted.spec, hosted.import_root]))
    """))

    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)

    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == ["my_script:ScriptEnv", str(tmp_path)]


def test_the_progress_table_replaces_transformers_printer_on_the_trainers_copy(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path)
    dataset = [{"prompt": [{"role": "user", "content": "q"}]}]

    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=lambda **kw: [0.0], train_dataset=dataset,
                               args=config, callbacks=[ProgressCallback()])

    kinds = [type(c) for c in trainer.callback_handler.callbacks]
    assert kinds.count(ProgressCallback) == 1 and kinds.count(PlotCallback) == 1  # the given one is not doubled
    assert PrinterCallback not in kinds and TqdmCallback not in kinds
    assert trainer.args.disable_tqdm is True and config.disable_tqdm is False  # the caller's config is untouched

    logged = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=lambda **kw: [0.0], train_dataset=dataset,
                              args=_config(tmp_path, progress="log", plots=False))
    kinds = [type(c) for c in logged.callback_handler.callbacks]
    assert TqdmCallback in kinds and ProgressCallback not in kinds and PlotCallback not in kinds


def test_an_unknown_progress_display_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"progress='bar' must be one of \('table', 'log'\)"):
        _config(tmp_path, progress="bar")


NEWCOMER_SCRIPT = '''
# train_launched.py: a newcomer's script, its environment defined here; argv: MODEL OUTPUT_DIR
import json
import random
import sys

import psutil
from transformers import TrainerCallback

from sdk import Environment
from trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from trainer.rewards import tool_error_penalty


class CounterEnv(Environment):
    """Reach the target by incrementing a counter."""

    def reset(self, seed=None, **kwargs):
        self.counter, self.target = 0, random.Random(seed).randint(1, 6)
        return f"Increment the counter to {self.target}."

    def get_reward(self):
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class Servers(TrainerCallback):
    """Notes the servers the trainer launched (its child processes) as training begins."""

    pids = []

    def on_train_begin(self, args, state, control, **kwargs):
        children = psutil.Process().children()
        Servers.pids = [p.pid for p in children if {"envserver.cli", "vllm.entrypoints.cli.main"} & set(p.cmdline())]


class CtrlC(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        raise KeyboardInterrupt


def alive(pids):
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def train(out, *callbacks):
    trainer = AsyncGRPOTrainer(
        model=sys.argv[1], environment_factory=CounterEnv, reward_funcs=tool_error_penalty,
        callbacks=[Servers(), *callbacks],
        args=AsyncGRPOConfig(output_dir=out, max_steps=2, num_generations=8, max_completion_length=48,
                             max_tool_calling_iterations=8, learning_rate=2e-4, use_cpu=True, report_to="none",
                             save_strategy="no", gradient_checkpointing=False, vllm_max_model_len=1024,
                             launch_vllm=True, launch_envserver=True))
    try:
        trainer.train()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    print("servers:", json.dumps({"launched": Servers.pids, "alive after train": alive(Servers.pids)}), flush=True)


if __name__ == "__main__":
    train(sys.argv[2] + "/run")
    train(sys.argv[2] + "/interrupted", CtrlC())
'''


@pytest.mark.vllm
@pytest.mark.timeout(1500)  # two vLLM CPU server starts, 1-3 min each on a loaded machine
def test_a_script_launches_both_servers_trains_and_leaves_none_behind_even_when_interrupted(
    warm_counter_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "train_launched.py"
    script.write_text(NEWCOMER_SCRIPT)

    out = subprocess.run([sys.executable, str(script), str(warm_counter_model_dir), str(tmp_path / "out")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=1400)

    assert out.returncode == 0, f"{out.stdout[-4000:]}\n--- stderr ---\n{out.stderr[-4000:]}"
    printed = out.stdout
    reports = [json.loads(line.removeprefix("servers: ")) for line in printed.splitlines()
               if line.startswith("servers: ")]
    assert len(reports) == 2, printed[-4000:]
    for report in reports:
        assert len(report["launched"]) == 2, report  # the env server and the vLLM server, children of the script
        assert report["alive after train"] == [], report
    assert printed.count("vLLM server ready at http://127.0.0.1:") == 2
    assert printed.count("env server ready at http://127.0.0.1:") == 2 and "hosting CounterEnv" in printed
    first_run, _, second_run = printed.partition("servers: ")
    assert re.search(r"^ +step +reward +dropped +len +gen tok/s", first_run, re.M), first_run[-3000:]  # the table
    assert "{'loss'" not in printed  # not transformers' raw log dicts
    assert "interrupted" not in first_run and "interrupted" in second_run
    assert sorted(p.name for p in (tmp_path / "out" / "run" / "plots").glob("*.png"))
    for pid in [p for r in reports for p in r["launched"]]:  # the script has exited: nothing it launched remains
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
