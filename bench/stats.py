"""The statistics the benchmarks report: quantiles and a bootstrap interval of the mean."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile, linear between the order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def bootstrap_ci(
    values: Sequence[float], *, confidence: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap interval for the mean of ``values``: the means of ``resamples``
    resamples with replacement, cut at both tails. Seeded, so a rerun prints the same."""
    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    rng = random.Random(seed)
    means = [statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples)]
    tail = (1 - confidence) / 2
    return quantile(means, tail), quantile(means, 1 - tail)
