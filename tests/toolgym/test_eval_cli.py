"""``toolgym eval``: flags from the field declarations, clear refusals, and real evaluations.

The real ones sample from the session's vLLM CPU server (the warm counter model's weights pushed into
it) against the session's env server, through the rollout loop training uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from envserver import ServerThread
from toolgym.cli import eval_serving
from toolgym.cli.eval import EvalArguments, build_parser, load_rows, main, parse_args
from toolgym.kit.counter_experiment import serve_policy
from trainer.exceptions import ConfigError
from trainer.launch.vllm_server import VLLMServer, free_port
from trainer.rollout.eval_results import EpisodeResult, read_episodes, summarize, write_run
from trainer.sync.weight_sync import WeightSynchronizer

COUNTER_FLAGS = ["--max_completion_length", "48", "--max_tool_calling_iterations", "8"]
ROOT = Path(__file__).resolve().parents[2]
REWARDS = textwrap.dedent("""
    import time
    from pathlib import Path

    CALLS = []


    def boom(completions, **kwargs):
        raise RuntimeError("the grader is broken")


    def slow(completions, **kwargs):  # the first episode finishes at once; the others later
        CALLS.append(1)
        if len(CALLS) == 2:
            time.sleep(1.0)
            Path(kwargs["marker"][0]).write_text("one episode has finished")
        if len(CALLS) > 1:
            time.sleep(5.0)
        return [0.0] * len(completions)
""")


def _prompt_rows(path: Path, count: int, **columns: object) -> Path:
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"say {i}"}], **columns}) + "\n"
                            for i in range(count)))
    return path


def test_every_field_is_a_flag_whose_help_is_its_declaration() -> None:
    text = build_parser().format_help()
    for f in dataclasses.fields(EvalArguments):
        assert f"--{f.name}" in text, f.name
        assert f.metadata.get("help"), f"{f.name} has no help"
    assert "Sampling temperature (0: greedy)." in " ".join(text.split())


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "m", "--environment", "counter", "--num_generation", "4"],
     r"unknown argument '--num_generation'; did you mean 'num_generations'"),
    (["--environment", "counter"], r"say what to evaluate: --model DIR"),
    (["--model", "m"], r"say what to evaluate on: --environment"),
    (["--model", "m", "--dataset", "rows.jsonl"], r"--dataset without --environment needs --reward_funcs"),
    (["--model", "m", "--environment", "counter", "--num_generations", "0"], r"at least 1 episode per row"),
    (["--model", "m", "--environment", "counter", "--temperature", "-1"], r"must be >= 0 \(0: greedy\)"),
    (["--compare", "a"], r"--compare takes two run folders \(A B\), got 1"),
    (["--model", "m", "--environment", "counter", "--top_k", "many"], r"--top_k.*invalid int value: 'many'"),
])
def test_bad_flags_are_refused_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("toolgym eval: ") and len(err.strip().splitlines()) == 1


def test_a_wrong_model_path_or_environment_fails_before_a_server_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Not marked vllm: starting a vLLM server here would fail the test (tests/conftest.py).
    assert main(["--model", str(tmp_path / "nowhere"), "--environment", "counter", "--output_dir",
                 str(tmp_path / "out")]) == 2
    assert "is not a model directory" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--environment", "countr", "--output_dir", str(tmp_path / "out")]) == 1
    assert "did you mean 'counter'" in capsys.readouterr().err


def test_rows_come_from_the_dataset_or_are_seeded_episodes(tmp_path: Path) -> None:
    seeded = load_rows(parse_args(["--model", "m", "--environment", "counter", "--num_rows", "3"]))
    assert seeded == [{"seed": 0}, {"seed": 1}, {"seed": 2}]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"target": t}) + "\n" for t in (1, 2, 3)))
    assert load_rows(parse_args(["--model", "m", "--environment", "counter", "--dataset", str(rows),
                                 "--num_rows", "2"])) == [{"target": 1}, {"target": 2}]
    with pytest.raises(ConfigError, match=r"its rows have no 'prompt' \(columns: \['target'\]\)"):
        load_rows(parse_args(["--model", "m", "--dataset", str(rows), "--reward_funcs", "trainer.rewards:x"]))
    rows.write_text("")
    with pytest.raises(ConfigError, match="could not be read"):
        load_rows(parse_args(["--model", "m", "--environment", "counter", "--dataset", str(rows)]))


def test_compare_prints_the_difference_of_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, wins in (("before", 3), ("after", 9)):
        episodes = [EpisodeResult(row_index=0, sample_index=i, reward=float(i < wins), success=i < wins)
                    for i in range(12)]
        write_run(tmp_path / name, episodes, summarize(episodes), {})
    assert main(["--compare", str(tmp_path / "before"), str(tmp_path / "after")]) == 0
    out = capsys.readouterr().out
    assert "after - before" in out and "+50.0%" in out
    assert main(["--compare", str(tmp_path / "before"), str(tmp_path / "missing")]) == 2


@pytest.mark.timeout(900)
def test_a_served_model_is_evaluated_against_an_env_server(
    vllm_server: VLLMServer, warm_counter_model_dir: Path, restore_served_weights: WeightSynchronizer,
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    serve_policy(vllm_server.base_url, warm_counter_model_dir)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"target": t}) + "\n" for t in (1, 2, 3)))
    out = tmp_path / "run"
    assert main(["--vllm_server_base_url", vllm_server.base_url, "--model", str(warm_counter_model_dir),
                 "--environment", f"{server.url}/counter", "--dataset", str(rows), "--group_by", "target",
                 "--num_generations", "4", "--output_dir", str(out), *COUNTER_FLAGS]) == 0
    table = capsys.readouterr().out
    episodes = read_episodes(out)
    assert len(episodes) == 12 and {e.task for e in episodes} == {"target=1", "target=2", "target=3"}
    for e in episodes:  # scored by the environment, as training scores: 1.0 exactly when the steps reach the target
        steps = sum(int(c["function"]["arguments"]["step"]) for m in e.completion for c in m.get("tool_calls") or []
                    if isinstance(c["function"]["arguments"], dict) and "step" in c["function"]["arguments"])
        assert e.rewards == {"RemoteEnvironment": float(steps == int(e.task.split("=")[1]))}, e
        assert e.error is None and e.policy_version == 0 and e.turns >= 1 and e.completion_tokens > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"]["episodes"] == 12 and sorted(summary["results"]["pass_at_k"]) == ["1", "2", "3", "4"]
    assert summary["run"]["environment"] == f"{server.url}/counter"
    assert summarize(episodes).success_rate.value > 0  # the warm model reaches some targets
    assert "target=3" in table and "pass@k  k=1:" in table


def test_a_server_url_where_no_server_answers_fails_in_seconds(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eval_serving, "RUNNING_SERVER_WAIT_S", 1.0)
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    assert main(["--vllm_server_base_url", url, "--model", str(tiny_model_dir), "--environment", "counter",
                 "--output_dir", str(tmp_path / "out")]) == 1
    assert time.monotonic() - t0 < 30
    assert f"no vLLM server answers at {url}" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_an_env_server_down_stops_at_once_and_a_raising_reward_fails_each_episode(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = ["--vllm_server_base_url", vllm_server.base_url, "--model", str(tiny_model_dir),
            "--max_completion_length", "8", "--num_generations", "2"]
    down = f"http://127.0.0.1:{free_port()}/counter"
    t0 = time.monotonic()
    assert main([*base, "--environment", down, "--output_dir", str(tmp_path / "down")]) == 1
    assert time.monotonic() - t0 < 60
    assert "toolgym eval: " in capsys.readouterr().err

    (tmp_path / "bad_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = _prompt_rows(tmp_path / "rows.jsonl", 3)
    out = tmp_path / "boom"
    assert main([*base, "--dataset", str(rows), "--reward_funcs", "bad_rewards:boom", "--output_dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert "failed episodes (6): reward function 'boom' raised RuntimeError: the grader is broken" in err
    episodes = read_episodes(out)
    assert len(episodes) == 6 and all(e.error and e.reward is None and e.turns == 1 for e in episodes)


@pytest.mark.timeout(600)
def test_ctrl_c_writes_the_episodes_that_finished(
        vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "slow_rewards.py").write_text(REWARDS)
    marker = tmp_path / "marker"
    rows = _prompt_rows(tmp_path / "rows.jsonl", 2, marker=str(marker))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    process = subprocess.Popen(
        [sys.executable, "-m", "toolgym", "eval", "--vllm_server_base_url", vllm_server.base_url, "--model",
         str(tiny_model_dir), "--dataset", str(rows), "--reward_funcs", "slow_rewards:slow", "--num_generations", "8",
         "--max_completion_length", "8", "--output_dir", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A suite started in the background by a non-interactive shell ignores SIGINT, and a child inherits
        # that: the eval would never see the Ctrl-C. The terminal's default is what a user has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():  # one episode scored, the others still in their reward function
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "no episode finished"
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, output
    assert "interrupted: the files hold the episodes that finished" in output
    episodes = read_episodes(out)
    assert 1 <= len(episodes) < 16
    assert json.loads((out / "summary.json").read_text())["run"]["interrupted"] is True
