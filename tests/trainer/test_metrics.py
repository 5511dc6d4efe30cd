"""The logging window's aggregation rules (docs/multiturn.md, "Metrics from your own hooks")."""

from __future__ import annotations

import math
import pickle

import pytest

from trainer.metrics import MetricWindow, RecordBuffer, reduction


@pytest.mark.parametrize(("name", "rule"), [
    ("sample/dropped_stale_count", "sum"),
    ("batch/dropped_oversize_count", "sum"),
    ("tools/search/call_count", "sum"),
    ("tools/max_finder/failure_count", "sum"),        # only the last part decides
    ("completions/max_length", "max"),
    ("sample/staleness_max", "max"),
    ("sampling/importance_sampling_ratio/max", "max"),
    ("completions/min_length", "min"),
    ("clip_ratio/low_min", "min"),
    ("sampling/importance_sampling_ratio/min", "min"),
    ("completions/max_terminated_length", "max"),
    ("completions/min_terminated_length", "min"),
    ("completions/mean_terminated_length", "mean"),   # "terMINated" is not the word min
    ("completions/mean_length", "mean"),
    ("reward", "mean"),
    ("count_reward", "sum"),                          # a name without '/' is its own last part
    ("rewards/count_xml/mean", "mean"),
    ("rollout/concurrency_cap", "mean"),
    ("perf/step_s", "mean"),
    ("batch/trained_tokens_per_step", "mean"),
])
def test_reduction_rule(name, rule):
    assert reduction(name) == rule


@pytest.mark.parametrize(("name", "values", "expected"), [
    ("sample/dropped_stale_count", [1, 0, 3], 4.0),
    ("completions/max_length", [5, 12, 7], 12.0),
    ("completions/max_length", [-3, -1, -2], -1.0),
    ("completions/min_length", [5, 2, 7], 2.0),
    ("clip_ratio/low_min", [0.5, 0.25, 0.75], 0.25),
    ("completions/mean_terminated_length", [10, 20, 60], 30.0),
    ("reward", [1.0, 0.0, 0.5, 0.5], 0.5),
    ("sample/staleness_max", [0], 0.0),
])
def test_window_reduces_values(name, values, expected):
    window = MetricWindow()
    for v in values:
        window.add(name, v)
    assert window.flush() == {name: expected}


def test_rate_is_ratio_of_sums_not_mean_of_ratios():
    window = MetricWindow()
    window.add_rate("rollout/generated_tokens_per_s", 100, 1.0)
    window.add_rate("rollout/generated_tokens_per_s", 0, 9.0)
    # sum 100 tokens / 10 s = 10, where the mean of ratios would be 50
    assert window.flush() == {"rollout/generated_tokens_per_s": 10.0}


def test_rate_wins_over_name_rule():
    window = MetricWindow()
    window.add_rate("tools/failure_count", 1, 4)
    window.add_rate("tools/failure_count", 1, 0)
    assert window.flush() == {"tools/failure_count": 0.5}


@pytest.mark.parametrize("parts", [[(0, 0)], [(0, 0), (0, 0)], [(3, 0)]])
def test_rate_with_zero_denominator_is_nan(parts):
    window = MetricWindow()
    for num, den in parts:
        window.add_rate("tools/failure_frequency", num, den)
    assert math.isnan(window.flush()["tools/failure_frequency"])


def test_flush_resets_the_window():
    window = MetricWindow()
    window.add("sample/dropped_stale_count", 5)
    window.add("completions/max_length", 100)
    window.add("reward", 1.0)
    window.add_rate("rollout/fork_frac", 1, 2)
    assert window.flush() == {"sample/dropped_stale_count": 5.0, "completions/max_length": 100.0,
                              "reward": 1.0, "rollout/fork_frac": 0.5}
    assert window.flush() == {}
    window.add("sample/dropped_stale_count", 2)
    window.add("completions/max_length", 3)
    window.add("reward", 0.0)
    window.add_rate("rollout/fork_frac", 0, 2)
    # nothing carried over from the first window: count restarts, max forgets 100, mean forgets 1.0
    assert window.flush() == {"sample/dropped_stale_count": 2.0, "completions/max_length": 3.0,
                              "reward": 0.0, "rollout/fork_frac": 0.0}


def test_names_reduce_independently():
    window = MetricWindow()
    for v in (1, 2, 3):
        window.add("rollout/turns_mean", v)
        window.add("rollout/turns_max", v)
        window.add("tools/unknown_name_count", v)
    assert window.flush() == {"rollout/turns_mean": 2.0, "rollout/turns_max": 3.0, "tools/unknown_name_count": 6.0}


def test_records_from_a_buffer_merge_into_the_window():
    buffer = RecordBuffer()
    buffer.add("sample/dropped_stale_count", 2)
    buffer.add("completions/max_length", 40)
    buffer.add("reward", 1.0)
    buffer.add_rate("rollout/generated_tokens_per_s", 300, 2.0)
    records = pickle.loads(pickle.dumps(buffer.take()))  # records cross a process boundary
    assert buffer.take() == []  # take empties the buffer

    window = MetricWindow()
    window.add("sample/dropped_stale_count", 1)
    window.add("completions/max_length", 50)
    window.add("reward", 0.0)
    window.add_rate("rollout/generated_tokens_per_s", 100, 2.0)
    window.add_records(records)
    assert window.flush() == {
        "sample/dropped_stale_count": 3.0,
        "completions/max_length": 50.0,
        "reward": 0.5,
        "rollout/generated_tokens_per_s": 100.0,
    }


def test_record_buffer_records_are_plain_tuples():
    buffer = RecordBuffer()
    buffer.add("reward", 1)
    buffer.add_rate("rollout/fork_frac", 1, 3)
    assert buffer.take() == [("value", "reward", 1.0, 0.0), ("rate", "rollout/fork_frac", 1.0, 3.0)]
