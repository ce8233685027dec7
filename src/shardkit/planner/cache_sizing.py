"""Cache sizing: choose the load factor of a caching kernel from a table's miss-ratio curve.

A cache larger than the point where the miss-ratio curve flattens buys nothing; one smaller than the
memory allows wastes hits. :func:`choose_load_factor` picks, for a memory budget, the smallest load
factor whose expected miss rate is within ``tolerance`` of the best the budget allows;
:func:`candidate_load_factors` gives the planner a few load factors along the curve to try as options
(it keeps the fastest that fits the memory). See docs/planner/cache_sizing.md.
"""

from __future__ import annotations

import math
from typing import List, Sequence

from shardkit.sharding.cache_params import CacheStatistics, SampledCacheStatistics

# miss rates the planner tries a cache for (each gives the smallest load factor reaching it)
MISS_RATE_LADDER = (0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.0)


def load_factor_for_miss_rate(stats: CacheStatistics, num_rows: int, max_miss_rate: float) -> float:
    """The smallest load factor whose ``stats.expected_miss_rate`` is at most ``max_miss_rate``.

    Exact (an integer number of rows / ``num_rows``) for :class:`SampledCacheStatistics`; for another
    ``CacheStatistics``, a bisection to one row, which assumes the miss rate does not rise with the
    load factor. At least one row; 1.0 when only the whole table reaches the target.
    """
    if num_rows < 1:
        raise ValueError(f"load_factor_for_miss_rate: num_rows must be >= 1, got {num_rows}")
    if not 0.0 <= max_miss_rate <= 1.0:
        raise ValueError(f"load_factor_for_miss_rate: max_miss_rate must be in [0, 1], got {max_miss_rate}")
    if isinstance(stats, SampledCacheStatistics) and stats.num_rows == num_rows:
        rows = stats.min_cache_rows(max_miss_rate)
    else:
        low, high = 0, num_rows  # miss(low / n) > target (or low == 0), miss(high / n) <= target
        while high - low > 1:
            mid = (low + high) // 2
            if stats.expected_miss_rate(mid / num_rows) <= max_miss_rate:
                high = mid
            else:
                low = mid
        rows = high
    return max(1, rows) / num_rows


def choose_load_factor(
    stats: CacheStatistics, num_rows: int, row_bytes: float, budget_bytes: float, tolerance: float = 0.0
) -> float:
    """The load factor of a cache of at most ``budget_bytes`` for a table (shard) of ``num_rows`` rows.

    Args:
        stats: the table's ``CacheStatistics`` (e.g. ``CacheStatistics.from_ids(ids, num_rows)``).
        row_bytes: bytes one cached row takes (its values plus the optimizer state kept with it).
        budget_bytes: the fast-tier memory the cache may use.
        tolerance: accepted loss of miss rate: the result is the smallest load factor whose expected
            miss rate is at most the budget's best plus ``tolerance`` (0: the smallest cache that is as
            good as the largest one that fits).

    Raises ``ValueError`` when the budget cannot hold one row (naming both sizes).
    """
    if row_bytes <= 0:
        raise ValueError(f"choose_load_factor: row_bytes must be positive, got {row_bytes}")
    if not 0.0 <= tolerance <= 1.0:
        raise ValueError(f"choose_load_factor: tolerance must be in [0, 1], got {tolerance}")
    max_rows = min(num_rows, math.floor(budget_bytes / row_bytes)) if budget_bytes >= 0 else 0
    if max_rows < 1:
        raise ValueError(
            f"choose_load_factor: a budget of {budget_bytes:g} bytes holds no row of {row_bytes:g} bytes"
        )
    largest = max_rows / num_rows
    best = stats.expected_miss_rate(largest)
    return min(largest, load_factor_for_miss_rate(stats, num_rows, min(1.0, best + tolerance)))


def candidate_load_factors(
    stats: CacheStatistics, num_rows: int, miss_rates: Sequence[float] = MISS_RATE_LADDER
) -> List[float]:
    """Distinct load factors, increasing: for each of ``miss_rates``, the smallest reaching it."""
    return sorted({load_factor_for_miss_rate(stats, num_rows, m) for m in miss_rates})


__all__ = ["MISS_RATE_LADDER", "candidate_load_factors", "choose_load_factor", "load_factor_for_miss_rate"]
