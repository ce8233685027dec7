"""How far a median of alternating rounds can be trusted on a shared machine: distribution-free
confidence intervals of the median, and the verdicts ``plan_quality`` draws from them.

A step's round times on a machine whose cores other work shares are far from normal (one 2-rank run
of the demo's tables, 40 rounds of 4 steps: min 2.0 ms, median 3.1, max 5.8-11 ms), so the interval
uses order statistics only: for ``n`` rounds, ``[x_(k), x_(n+1-k)]`` with ``k`` the largest rank for
which the binomial tail ``P(Bin(n, 1/2) <= k - 1)`` is at most ``(1 - level) / 2`` on each side. It
covers the true median of the rounds' distribution with probability >= ``level`` whatever that
distribution, provided the rounds are independent draws from it (a load that drifts during the run
breaks that: the interval then covers the run's mixture, not one load).
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple


def _interval_rank(n: int, level: float) -> int:
    """The largest ``k >= 1`` with ``P(Bin(n, 1/2) <= k - 1) <= (1 - level) / 2`` (1 if none)."""
    tail = (1.0 - level) / 2.0
    k, cumulative = 1, 0.0
    for j in range(1, n // 2 + 1):
        cumulative += math.comb(n, j - 1) / 2.0**n  # P(Bin(n, 1/2) <= j - 1)
        if cumulative > tail:
            break
        k = j
    return k


def median_ci(values: Sequence[float], level: float = 0.95) -> Tuple[float, float]:
    """``(low, high)``: the order-statistic interval of the median of ``values`` (module doc). Under 9
    values (at 95 %) the whole range; under 6 its coverage, ``1 - 2^(1-n)``, is below ``level``
    (93.75 % for 5 rounds), which the caller should say (:func:`coverage`)."""
    if not values:
        raise ValueError("median_ci needs at least one value")
    if not 0.0 < level < 1.0:
        raise ValueError(f"median_ci: level must be in (0, 1), got {level}")
    xs = sorted(values)
    n = len(xs)
    k = _interval_rank(n, level)
    return xs[k - 1], xs[n - k]


def coverage(n: int, level: float = 0.95) -> float:
    """The coverage of :func:`median_ci` for ``n`` values: ``1 - 2 P(Bin(n, 1/2) <= k - 1)``."""
    k = _interval_rank(n, level)
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0**n


def overlaps(a: Tuple[float, float], b: Tuple[float, float]) -> bool:
    """Whether two intervals share a point: the measurement cannot order their medians."""
    return a[0] <= b[1] and b[0] <= a[1]


def within_of_interval(estimate: float, interval: Tuple[float, float], tolerance: float) -> bool:
    """Whether ``estimate`` is within ``tolerance`` (relative) of some point of ``interval``:
    ``low (1 - tolerance) <= estimate <= high (1 + tolerance)``."""
    low, high = interval
    return low * (1.0 - tolerance) <= estimate <= high * (1.0 + tolerance)


def relative_spread(values: Sequence[float]) -> float:
    """``(q75 - q25) / median`` of ``values`` (nearest ranks): how much a step's rounds scatter."""
    xs: List[float] = sorted(values)
    n = len(xs)
    median = xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
    return (xs[(3 * (n - 1)) // 4] - xs[(n - 1) // 4]) / median if median > 0 else 0.0


__all__ = ["coverage", "median_ci", "overlaps", "relative_spread", "within_of_interval"]
