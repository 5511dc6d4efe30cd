"""The statistics of an evaluation: intervals, pass@k and the comparison of two runs.

Plain Python (no SciPy), each function one textbook formula:

* a success rate's 95 % interval is Wilson's score interval (it stays inside [0, 1] and keeps its
  coverage near 0 % and 100 %, where the normal approximation's does not);
* a mean reward's is the normal approximation ``mean ± z·s/√n`` (``s``: the sample standard deviation);
* pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code"): from ``n`` samples of a prompt of which ``c`` succeed, ``1 - C(n-c, k) / C(n, k)``,
  averaged over the prompts;
* two runs' success rates are compared by the difference ``p_B - p_A`` with Newcombe's hybrid
  score interval (built from the two Wilson intervals) and a two-sided two-proportion z-test
  (pooled standard error); two mean rewards by the difference with Welch's normal interval.

Every episode counts as an independent trial. Episodes of one prompt are not (they share the prompt's
difficulty), so with few prompts the intervals are optimistic; the per-task rows show how much the
prompts differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Z95",
    "Difference",
    "Estimate",
    "compare_means",
    "compare_proportions",
    "mean_estimate",
    "pass_at_k",
    "pass_at_k_curve",
    "proportion_estimate",
    "wilson_interval",
]

Z95 = 1.959963984540054
"""The standard normal's 97.5 % quantile: a two-sided 95 % interval is ``± Z95`` standard errors."""


@dataclass(frozen=True)
class Estimate:
    """A measured value with its 95 % interval.

    Attributes:
        value: The estimate (a proportion or a mean); NaN with no observation.
        low: The interval's lower end.
        high: The interval's upper end.
        n: Observations it is made from.
    """

    value: float
    low: float
    high: float
    n: int


@dataclass(frozen=True)
class Difference:
    """Run B minus run A, with its 95 % interval and a two-sided test of "no difference".

    Attributes:
        value: ``B - A``.
        low: The interval's lower end.
        high: The interval's upper end.
        z: The test statistic (difference over its standard error under no difference).
        p_value: Two-sided p-value of ``z``; 1.0 when the standard error is 0 (identical constant runs).
    """

    value: float
    low: float
    high: float
    z: float
    p_value: float


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of a proportion ``successes / n``; ``(0, 1)`` when ``n == 0``."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # Exactly 0 and 1 at the ends (the formula leaves a rounding error there).
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def proportion_estimate(successes: int, n: int) -> Estimate:
    """The proportion ``successes / n`` with its Wilson interval (NaN when ``n == 0``)."""
    low, high = wilson_interval(successes, n)
    return Estimate(successes / n if n else math.nan, low, high, n)


def mean_estimate(values: Sequence[float]) -> Estimate:
    """The mean of ``values`` with its normal-approximation interval (zero width for one value)."""
    n = len(values)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0)
    mean = math.fsum(values) / n
    if n == 1:
        return Estimate(mean, mean, mean, 1)
    half = Z95 * math.sqrt(_sample_variance(values, mean) / n)
    return Estimate(mean, mean - half, mean + half, n)


def _sample_variance(values: Sequence[float], mean: float) -> float:
    return math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt: ``n`` samples, ``c`` of them successes, ``1 <= k <= n``.

    The probability that at least one of ``k`` samples drawn without replacement from the ``n``
    succeeds: ``1 - C(n-c, k) / C(n, k)``, computed as a product to stay exact for large ``n``.

    Raises:
        ValueError: ``k`` is outside ``[1, n]`` or ``c`` outside ``[0, n]``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n successes, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    failure = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{i=n-c+1..n} (1 - k/i)
        failure *= 1.0 - k / i
    return 1.0 - failure


def pass_at_k_curve(per_prompt: Sequence[tuple[int, int]]) -> dict[int, float]:
    """pass@k for ``k`` in ``1..n``: the mean over prompts of :func:`pass_at_k`.

    Args:
        per_prompt: ``(n, c)`` per prompt: its samples and its successes. ``n`` is the smallest
            prompt's (a prompt with fewer samples cannot estimate a larger ``k``).

    Returns:
        ``{k: pass@k}``, empty when there is no prompt.
    """
    if not per_prompt:
        return {}
    n_max = min(n for n, _ in per_prompt)
    return {k: math.fsum(pass_at_k(n, c, k) for n, c in per_prompt) / len(per_prompt) for k in range(1, n_max + 1)}


def _two_sided_p(z: float) -> float:
    return math.erfc(abs(z) / math.sqrt(2))


def compare_proportions(successes_a: int, n_a: int, successes_b: int, n_b: int) -> Difference:
    """``p_B - p_A`` with Newcombe's hybrid score interval and the pooled two-proportion z-test.

    Raises:
        ValueError: A run has no episode.
    """
    if n_a == 0 or n_b == 0:
        raise ValueError(f"comparing success rates needs episodes in both runs, got n_A={n_a}, n_B={n_b}")
    p_a, p_b = successes_a / n_a, successes_b / n_b
    low_a, high_a = wilson_interval(successes_a, n_a)
    low_b, high_b = wilson_interval(successes_b, n_b)
    diff = p_b - p_a
    # Newcombe (1998), method 10: each run's own score interval, combined.
    low = diff - math.sqrt((p_b - low_b) ** 2 + (high_a - p_a) ** 2)
    high = diff + math.sqrt((high_b - p_b) ** 2 + (p_a - low_a) ** 2)
    pooled = (successes_a + successes_b) / (n_a + n_b)
    standard_error = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    z = diff / standard_error if standard_error > 0 else 0.0
    return Difference(diff, low, high, z, _two_sided_p(z) if standard_error > 0 else 1.0)


def compare_means(values_a: Sequence[float], values_b: Sequence[float]) -> Difference:
    """``mean(B) - mean(A)`` with Welch's normal-approximation interval and z-test.

    Raises:
        ValueError: A run has fewer than two values (no variance to estimate).
    """
    if len(values_a) < 2 or len(values_b) < 2:
        raise ValueError(f"comparing mean rewards needs two or more scored episodes per run, got "
                         f"{len(values_a)} and {len(values_b)}")
    mean_a, mean_b = math.fsum(values_a) / len(values_a), math.fsum(values_b) / len(values_b)
    standard_error = math.sqrt(_sample_variance(values_a, mean_a) / len(values_a)
                               + _sample_variance(values_b, mean_b) / len(values_b))
    diff = mean_b - mean_a
    half = Z95 * standard_error
    z = diff / standard_error if standard_error > 0 else 0.0
    return Difference(diff, diff - half, diff + half, z, _two_sided_p(z) if standard_error > 0 else 1.0)
