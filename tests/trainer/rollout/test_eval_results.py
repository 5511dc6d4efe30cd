"""An evaluation's records, summary, files, table and comparison of two runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.exceptions import ConfigError
from trainer.rollout.eval_results import (
    EpisodeResult,
    EvalSummary,
    compare_runs,
    format_comparison,
    format_table,
    read_episodes,
    summarize,
    write_run,
)


def _episodes(successes_per_row: dict[int, list[bool]], tool_calls: int = 1) -> list[EpisodeResult]:
    return [EpisodeResult(row_index=row, sample_index=i, task=f"target={row}", reward=float(ok), success=ok,
                          tool_calls=tool_calls, turns=2, completion_tokens=10,
                          prompt=[{"role": "user", "content": f"reach {row}"}],
                          completion=[{"role": "assistant", "content": "done"}])
            for row, outcomes in successes_per_row.items() for i, ok in enumerate(outcomes)]


def test_summary_counts_every_episode_and_each_task() -> None:
    episodes = _episodes({1: [True, True, False, False], 2: [False, False, False, True]})
    episodes.append(EpisodeResult(row_index=2, sample_index=4, task="target=2", error="env server lost"))
    summary = summarize(episodes)
    assert (summary.episodes, summary.failed_episodes) == (9, 1)
    assert summary.success_rate.value == pytest.approx(3 / 9)  # a failed episode counts as a failure
    assert summary.mean_reward.n == 8  # and is not scored
    assert list(summary.tasks) == ["target=1", "target=2"]
    assert summary.tasks["target=1"].success_rate.value == 0.5
    assert sorted(summary.pass_at_k) == [1, 2, 3, 4]  # the smallest prompt has 4 episodes
    assert summary.pass_at_k[1] == pytest.approx((2 / 4 + 1 / 5) / 2)
    assert summary.tool_calls_per_episode == pytest.approx(8 / 9)


def test_tasks_sort_numerically() -> None:
    episodes = _episodes({10: [True], 2: [False], 1: [True]})
    assert list(summarize(episodes).tasks) == ["target=1", "target=2", "target=10"]


def test_metrics_are_named_as_transformers_names_evaluation_metrics() -> None:
    metrics = summarize(_episodes({1: [True, False]})).metrics()
    assert metrics["eval_success_rate"] == 0.5
    assert metrics["eval_pass@2"] == 1.0
    assert metrics["eval_task/target=1/success_rate"] == 0.5
    assert metrics["eval_success_rate_low"] < 0.5 < metrics["eval_success_rate_high"]


def test_files_hold_one_line_per_episode_and_the_summary(tmp_path: Path) -> None:
    episodes = _episodes({1: [True, False], 2: [True, True]})
    summary = summarize(episodes)
    folder = write_run(tmp_path / "run", list(reversed(episodes)), summary, {"model": "m"})
    lines = (folder / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4
    first = json.loads(lines[0])
    assert (first["row_index"], first["sample_index"], first["reward"]) == (1, 0, 1.0)
    assert first["prompt"] == [{"role": "user", "content": "reach 1"}]
    document = json.loads((folder / "summary.json").read_text())
    assert document["run"] == {"model": "m"}
    assert EvalSummary.from_json(document["results"]) == summary
    assert read_episodes(folder) == sorted(episodes, key=lambda e: (e.row_index, e.sample_index))


def test_table_shows_interval_tasks_and_pass_at_k() -> None:
    table = format_table(summarize(_episodes({1: [True, False] * 4, 2: [False] * 8})))
    lines = table.splitlines()
    assert lines[1].startswith("all") and "25.0% [" in lines[1]
    assert lines[2].startswith("target=1") and lines[3].startswith("target=2")
    assert lines[-1] == "pass@k  k=1: 25.0%  k=2: 39.3%  k=4: 49.3%  k=8: 50.0%"


def test_compare_runs_gives_the_difference_its_interval_and_test(tmp_path: Path) -> None:
    before = _episodes({1: [True] + [False] * 9, 2: [False] * 10})
    after = _episodes({1: [True] * 8 + [False] * 2, 2: [True] * 5 + [False] * 5})
    write_run(tmp_path / "a", before, summarize(before), {})
    write_run(tmp_path / "b", after, summarize(after), {})
    comparison = compare_runs(tmp_path / "a", tmp_path / "b")
    assert comparison.success.value == pytest.approx(0.6)
    assert comparison.success.low > 0 and comparison.success.p_value < 0.001
    assert list(comparison.tasks) == ["target=1", "target=2"]
    text = format_comparison(comparison, "before", "after")
    assert "+60.0%" in text and "mean reward: 0.050 -> 0.650" in text


def test_compare_refuses_a_folder_that_is_no_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pass the folder of a toolgym eval run"):
        compare_runs(tmp_path, tmp_path)
    (tmp_path / "results.jsonl").write_text("not json\n")
    with pytest.raises(ConfigError, match=r"results.jsonl:1 is not an episode record"):
        read_episodes(tmp_path)
    (tmp_path / "results.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds no episode"):
        compare_runs(tmp_path, tmp_path)
