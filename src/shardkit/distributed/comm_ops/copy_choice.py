"""Which of two ways of moving the same values is faster at a given row count: both timed at a few row
counts once, the times interpolated in between.

The column placement (``placement.py``) moves a rank's received columns either by a native copier (a
memcpy per row and column range) or by strided torch copies (one op per run of blocks). Their costs
depend on the layout and the machine in ways no fixed rule caught (module doc there), so both are timed
on the layout itself: at each of :data:`TRIAL_ROWS`, the fastest of :data:`TRIAL_SAMPLES` calls after
a warm-up, the two ways alternating (a burst of load elsewhere hits both alike). A call of ``rows``
rows compares the two times interpolated linearly in ``rows`` between the trials around it (a
copy's time is close to affine in its rows), extrapolated past the last trial along the last segment,
and taken as the first trial's below it (fixed costs dominate there).
"""

from __future__ import annotations

import bisect
import math
import time
from typing import Callable, Sequence, Tuple

# the row counts timed (the sweep's batches a rank), and the largest trial in bytes: row counts past it
# are not timed (a layout of very many columns), the last timed segment is extrapolated instead
TRIAL_ROWS = (32, 256, 2048)
TRIAL_BYTES = 16 << 20
TRIAL_SAMPLES = 5

Trial = Tuple[int, float, float]  # (rows, seconds of the first way, seconds of the second way)
Ways = Tuple[Callable[[], None], Callable[[], None]]


def time_trials(make_ways: Callable[[int], Ways], bytes_per_row: int) -> Tuple[Trial, ...]:
    """Both ways timed at each of :data:`TRIAL_ROWS` whose ``rows * bytes_per_row`` fits
    :data:`TRIAL_BYTES` (always at least the first). ``make_ways(rows)`` returns the two calls for
    ``rows`` rows (their tensors allocated once, outside the timing)."""
    trials = []
    for rows in TRIAL_ROWS:
        if trials and rows * bytes_per_row > TRIAL_BYTES:
            break
        ways = make_ways(rows)
        best = [math.inf, math.inf]
        for sample in range(TRIAL_SAMPLES + 1):
            for i, way in enumerate(ways):
                start = time.perf_counter()
                way()
                seconds = time.perf_counter() - start
                if sample:  # the first call of each way warms it up
                    best[i] = min(best[i], seconds)
        trials.append((rows, best[0], best[1]))
    return tuple(trials)


def first_is_faster(trials: Sequence[Trial], rows: int) -> bool:
    """Whether the first way's interpolated time at ``rows`` is below the second's (module doc)."""
    if len(trials) == 1 or rows <= trials[0][0]:
        return trials[0][1] < trials[0][2]
    # the segment around rows; past the last trial, the last segment
    i = min(bisect.bisect_left([t[0] for t in trials], rows), len(trials) - 1)
    (r0, a0, b0), (r1, a1, b1) = trials[i - 1], trials[i]
    f = (rows - r0) / (r1 - r0)
    return a0 + f * (a1 - a0) < b0 + f * (b1 - b0)


__all__ = ["TRIAL_BYTES", "TRIAL_ROWS", "TRIAL_SAMPLES", "Trial", "first_is_faster", "time_trials"]
