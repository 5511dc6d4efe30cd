"""The evaluation statistics against their textbook definitions and published values."""

from __future__ import annotations

import math

import pytest

from trainer.rollout.eval_stats import (
    compare_means,
    compare_proportions,
    mean_estimate,
    pass_at_k,
    pass_at_k_curve,
    proportion_estimate,
    wilson_interval,
)


@pytest.mark.parametrize("successes,n,low,high", [
    (0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0), (81, 263, 0.2553, 0.3662)])
def test_wilson_interval_matches_published_values(successes: int, n: int, low: float, high: float) -> None:
    got = wilson_interval(successes, n)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_the_interval_ends_exactly_at_zero_and_one() -> None:
    assert wilson_interval(0, 6)[0] == 0.0 and wilson_interval(6, 6)[1] == 1.0


def test_a_proportion_without_episodes_is_nan_with_the_whole_range() -> None:
    estimate = proportion_estimate(0, 0)
    assert math.isnan(estimate.value) and (estimate.low, estimate.high) == (0.0, 1.0)


def test_pass_at_k_is_the_combinatorial_definition() -> None:
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_stays_exact_where_the_binomials_overflow_floats() -> None:
    assert pass_at_k(2000, 1, 1) == pytest.approx(1 / 2000)
    assert pass_at_k(2000, 0, 1000) == 0.0


@pytest.mark.parametrize("n,c,k", [(4, 1, 0), (4, 1, 5), (4, 5, 1)])
def test_pass_at_k_refuses_impossible_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_pass_at_k_curve_averages_prompts_and_stops_at_the_smallest_n() -> None:
    curve = pass_at_k_curve([(4, 0), (4, 4), (3, 1)])
    assert sorted(curve) == [1, 2, 3]
    assert curve[1] == pytest.approx((0 + 1 + 1 / 3) / 3)
    assert curve[3] == pytest.approx((0 + 1 + 1) / 3)
    assert pass_at_k_curve([]) == {}


def test_mean_interval_is_normal_approximation() -> None:
    values = [0.0, 1.0, 1.0, 0.0, 1.0]
    estimate = mean_estimate(values)
    half = 1.959964 * math.sqrt(0.3 / 5)
    assert (estimate.value, estimate.low, estimate.high) == pytest.approx((0.6, 0.6 - half, 0.6 + half))
    assert mean_estimate([0.5]).low == 0.5
    assert math.isnan(mean_estimate([]).value)


def test_newcombe_interval_and_z_test_match_newcombe_1998_example() -> None:
    # Newcombe (1998), Statistics in Medicine 17:873, example (a): 56/70 against 48/80, method 10.
    d = compare_proportions(48, 80, 56, 70)
    assert d.value == pytest.approx(0.2)
    assert (d.low, d.high) == pytest.approx((0.0524, 0.3339), abs=1e-4)
    pooled = 104 / 150
    z = 0.2 / math.sqrt(pooled * (1 - pooled) * (1 / 70 + 1 / 80))
    assert d.z == pytest.approx(z)
    assert d.p_value == pytest.approx(math.erfc(z / math.sqrt(2)))


def test_identical_constant_runs_differ_by_nothing_with_p_one() -> None:
    d = compare_proportions(10, 10, 10, 10)
    assert (d.value, d.z, d.p_value) == (0.0, 0.0, 1.0)
    assert d.low <= 0.0 <= d.high


def test_comparing_without_episodes_says_which_run_is_empty() -> None:
    with pytest.raises(ValueError, match="n_A=0, n_B=3"):
        compare_proportions(0, 0, 1, 3)
    with pytest.raises(ValueError, match="two or more scored episodes"):
        compare_means([1.0], [0.0, 1.0])


def test_welch_difference_of_means() -> None:
    a, b = [0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0, 1.0]
    d = compare_means(a, b)
    se = math.sqrt((1 / 3) / 4 + 0.2 / 5)
    assert d.value == pytest.approx(0.3)
    assert (d.low, d.high) == pytest.approx((0.3 - 1.959964 * se, 0.3 + 1.959964 * se), abs=1e-6)
    assert d.z == pytest.approx(0.3 / se)
