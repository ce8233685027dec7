"""The order-statistic interval of a median: its ranks, its coverage, and the checks built on it."""

from __future__ import annotations

import math

import pytest
import torch
from benchmarks.round_noise import coverage, median_ci, overlaps, relative_spread, within_of_interval


def test_the_interval_of_15_rounds_is_the_4th_to_the_12th():
    assert median_ci([float(x) for x in range(15, 0, -1)]) == (4.0, 12.0)
    # P(Bin(15, 1/2) <= 3) = 576 / 32768 on each side
    assert coverage(15) == pytest.approx(1.0 - 2 * 576 / 32768)


def test_too_few_rounds_give_the_whole_range_and_say_its_coverage():
    assert median_ci([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    assert coverage(5) == pytest.approx(1.0 - 2.0 ** (1 - 5))
    assert median_ci([7.0]) == (7.0, 7.0)
    with pytest.raises(ValueError, match="at least one"):
        median_ci([])
    with pytest.raises(ValueError, match="level"):
        median_ci([1.0], level=1.0)


def test_the_interval_covers_the_median_at_least_as_often_as_it_says():
    gen = torch.Generator().manual_seed(0)
    n, trials, hits = 15, 4000, 0
    # a skewed distribution, as round times under load are: exponential, median ln 2
    samples = -torch.log(torch.rand(trials, n, generator=gen, dtype=torch.float64))
    for row in samples.tolist():
        low, high = median_ci(row)
        hits += low <= math.log(2.0) <= high
    assert hits / trials >= coverage(n) - 0.015  # three standard errors of 4000 trials


def test_overlap_and_the_tolerance_around_an_interval():
    assert overlaps((1.0, 2.0), (2.0, 3.0)) and not overlaps((1.0, 1.9), (2.0, 3.0))
    assert within_of_interval(1.25 * 2.0, (1.0, 2.0), 0.25)
    assert not within_of_interval(1.26 * 2.0, (1.0, 2.0), 0.25)
    assert within_of_interval(0.75, (1.0, 2.0), 0.25) and not within_of_interval(0.74, (1.0, 2.0), 0.25)


def test_relative_spread_is_the_interquartile_range_over_the_median():
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.0 - 2.0) / 3.0)
    assert relative_spread([2.0] * 4) == 0.0
