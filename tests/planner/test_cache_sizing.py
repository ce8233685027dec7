"""Choosing a caching kernel's load factor from a miss-ratio curve (planner/cache_sizing.py)."""

from __future__ import annotations

import pytest
import torch

from shardkit.planner.cache_sizing import (
    MISS_RATE_LADDER,
    candidate_load_factors,
    choose_load_factor,
    load_factor_for_miss_rate,
)
from shardkit.sharding.cache_params import CacheStatistics, SampledCacheStatistics, cache_rows

ROWS = 1000


def _zipf_stats(rows=ROWS, n=4000, exponent=1.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** exponent
    ids = torch.randperm(rows, generator=g)[torch.multinomial(weights, n, replacement=True, generator=g)]
    return SampledCacheStatistics(list(ids.split(500)), rows)


class _Linear(CacheStatistics):
    """Uniform ids: miss rate 1 - clf (not a sample: the bisection path)."""

    expected_lookups = 10.0
    cacheability = 0.5

    def expected_miss_rate(self, clf: float) -> float:
        return 1.0 - clf


def test_load_factor_for_a_miss_rate_is_the_smallest_reaching_it():
    stats = _zipf_stats()
    for target in (0.6, 0.3, 0.1, 0.0):
        lf = load_factor_for_miss_rate(stats, ROWS, target)
        rows = round(lf * ROWS)
        assert stats.miss_ratio(rows) <= target + 1e-12
        assert rows == 1 or stats.miss_ratio(rows - 1) > target  # one row fewer misses the target
        assert cache_rows(ROWS, lf) == rows  # the storage's rule gives the same cache
    assert load_factor_for_miss_rate(_Linear(), ROWS, 0.25) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="max_miss_rate"):
        load_factor_for_miss_rate(stats, ROWS, 1.5)


def test_choose_load_factor_for_a_budget():
    stats = _zipf_stats()
    row_bytes = 64 * 4 + 4  # fp32 values and a row-wise Adagrad state
    budget = 100 * row_bytes + 10  # room for 100 rows
    lf = choose_load_factor(stats, ROWS, row_bytes, budget)
    assert cache_rows(ROWS, lf) * row_bytes <= budget
    # as good as the largest cache that fits, and no smaller cache is as good
    assert stats.expected_miss_rate(lf) == pytest.approx(stats.miss_ratio(100))
    rows = cache_rows(ROWS, lf)
    assert rows == 1 or stats.miss_ratio(rows - 1) > stats.miss_ratio(100)
    # past the sample's distinct ids the curve is flat (the sample says nothing of larger caches): a
    # budget there buys the informed size's miss rate at the informed size, and only the whole
    # table misses nothing
    assert stats.informed_rows < ROWS
    past = choose_load_factor(stats, ROWS, row_bytes, (ROWS - 1) * row_bytes)
    assert cache_rows(ROWS, past) <= stats.informed_rows
    assert stats.expected_miss_rate(past) == pytest.approx(stats.miss_ratio(stats.informed_rows))
    huge = choose_load_factor(stats, ROWS, row_bytes, 10 * ROWS * row_bytes)
    assert stats.expected_miss_rate(huge) == 0.0
    assert cache_rows(ROWS, huge) == stats.min_cache_rows(0.0) == ROWS
    # a tolerance trades a little miss rate for a smaller cache
    loose = choose_load_factor(stats, ROWS, row_bytes, budget, tolerance=0.05)
    assert loose < lf and stats.expected_miss_rate(loose) <= stats.miss_ratio(100) + 0.05
    # bisection path: uniform ids, the budget's largest cache
    assert choose_load_factor(_Linear(), ROWS, 8, 8 * 250) == pytest.approx(0.25)


def test_a_budget_without_room_for_one_row_is_an_error():
    with pytest.raises(ValueError, match="budget of 100 bytes holds no row of 260 bytes"):
        choose_load_factor(_zipf_stats(), ROWS, 260, 100)


def test_candidates_follow_the_ladder():
    stats = _zipf_stats()
    candidates = candidate_load_factors(stats, ROWS)
    assert candidates == sorted(set(candidates))
    assert candidates == sorted({load_factor_for_miss_rate(stats, ROWS, m) for m in MISS_RATE_LADDER})
    assert stats.expected_miss_rate(candidates[-1]) == 0.0
