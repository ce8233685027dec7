"""Which of a few ways of moving the same values is fastest at a given row count: each timed at a few
row counts once, the times interpolated in between.

The column placement (``placement.py``) moves a rank's received columns by a native copier (a memcpy
per row and column range), by strided torch copies (one op per run of blocks) or by one index copy
over the blocks. Their costs depend on the layout and the machine in ways no fixed rule caught (module
doc there), so each is timed on the layout itself: at each of :data:`TRIAL_ROWS`, the fastest of
:data:`TRIAL_SAMPLES` calls after a warm-up, the ways taking turns (a burst of load elsewhere hits all
alike). A call of ``rows`` rows compares the times interpolated linearly in ``rows`` between the trials
around it (a copy's time is close to affine in its rows), extrapolated past the last trial along the
last segment, and taken as the first trial's below it (fixed costs dominate there).
"""

from __future__ import annotations

import bisect
import math
import time
from typing import Callable, Optional, Sequence, Tuple

# the row counts timed (the sweep's batches a rank), and the largest trial in bytes: row counts past it
# are not timed (a layout of very many columns), the last timed segment is extrapolated instead
TRIAL_ROWS = (32, 256, 2048)
TRIAL_BYTES = 16 << 20
TRIAL_SAMPLES = 5

Trial = Tuple[int, Tuple[float, ...]]  # (rows, seconds of each way)


def time_trials(
    make_ways: Callable[[int], Sequence[Optional[Callable[[], None]]]],
    bytes_per_row: int,
    row_counts: Sequence[int] = TRIAL_ROWS,
    samples: int = TRIAL_SAMPLES,
) -> Tuple[Trial, ...]:
    """Every way timed (the fastest of ``samples`` calls after a warm-up) at each of ``row_counts``
    whose ``rows * bytes_per_row`` fits :data:`TRIAL_BYTES` (always at least the first).
    ``make_ways(rows)`` returns the calls for ``rows`` rows (their tensors allocated once, outside the
    timing), in the same order at every row count; a way given as None is not timed (its time is
    infinite: never the fastest)."""
    trials = []
    for rows in row_counts:
        if trials and rows * bytes_per_row > TRIAL_BYTES:
            break
        ways = make_ways(rows)
        best = [math.inf] * len(ways)
        for sample in range(samples + 1):
            for i, way in enumerate(ways):
                if way is None:
                    continue
                start = time.perf_counter()
                way()
                seconds = time.perf_counter() - start
                if sample:  # the first call of each way warms it up
                    best[i] = min(best[i], seconds)
        trials.append((rows, tuple(best)))
    return tuple(trials)


def fastest(trials: Sequence[Trial], rows: int, allowed: Optional[Sequence[bool]] = None) -> int:
    """The index of the way whose time interpolated at ``rows`` is the least (module doc), among the
    ``allowed`` ones (default: all; at least one must be allowed); the first such on a tie."""
    if len(trials) == 1 or rows <= trials[0][0]:
        times = trials[0][1]
    else:
        # the segment around rows; past the last trial, the last segment
        i = min(bisect.bisect_left([t[0] for t in trials], rows), len(trials) - 1)
        (r0, t0), (r1, t1) = trials[i - 1], trials[i]
        f = (rows - r0) / (r1 - r0)
        # a way not timed (inf at every trial) stays inf, not inf - inf
        times = tuple(a + f * (b - a) if math.isfinite(a + b) else math.inf for a, b in zip(t0, t1))
    candidates = [w for w in range(len(times)) if allowed is None or allowed[w]]
    return min(candidates, key=lambda w: times[w])


__all__ = ["TRIAL_BYTES", "TRIAL_ROWS", "TRIAL_SAMPLES", "Trial", "fastest", "time_trials"]
