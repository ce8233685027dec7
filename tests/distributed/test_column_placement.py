"""ColumnPlacement: the received blocks put in place (and the gradient split back) exactly as the
concatenation in rank order followed by the column permutation, by each of its ways (a column-range
copier, the native one and its pure-torch twin; strided runs; one index copy) forced on every rank and
as timed; the choice among the ways follows their timed trials (``copy_choice``; no timings are checked
here: trials are made up where a choice is asserted)."""

from __future__ import annotations

import math

import pytest
import torch

from shardkit.distributed.comm_ops import copy_choice, placement
from shardkit.distributed.comm_ops.placement import MAX_RUNS, MAX_TIMED_RUNS, ColumnPlacement, arithmetic_runs
from shardkit.kernels.column_copy import column_copier, copy_column_ranges_torch

# None: the strided copies and the index copy only; the twin; the native op where it is built
COPIERS = [None, copy_column_ranges_torch] + ([column_copier()] if column_copier() is not None else [])
# every copier with the timed choice and each of its ways forced (no copier: no copier way to force)
COPIER_WAYS = [
    (copier, way)
    for copier in COPIERS
    for way in ("timed", "copier", "strided", "index")
    if not (copier is None and way == "copier")
]


def _reference_order(placement: ColumnPlacement):
    """Output column -> column of the rank-ordered concatenation."""
    w = placement.width
    source = [0] * (placement.blocks * w)
    start = 0
    for dest in placement.dest:
        for k, block in enumerate(dest):
            for c in range(w):
                source[block * w + c] = start + k * w + c
        start += len(dest) * w
    return torch.tensor(source)


@pytest.mark.parametrize(
    "width, dest",
    [
        (4, [[0, 2, 4], [1, 3, 5]]),  # round-robin tables: one strided run per rank
        (3, [[1, 2], [0], [3, 4, 5]]),  # three ranks, contiguous runs
        (2, [[], [1, 0, 2]]),  # a rank with nothing, a descending step
        # more runs than MAX_RUNS on rank 0: the index copy off the CPU
        (
            1,
            [
                list(range(0, 4 * (MAX_RUNS + 2), 4)) + [1],
                [b for b in range(4 * (MAX_RUNS + 2)) if b % 4 and b != 1],
            ],
        ),
    ],
)
@pytest.mark.parametrize("rows", [5, 0])
@pytest.mark.parametrize("copier, way", COPIER_WAYS)
def test_assemble_and_split_are_cat_and_permute(width, dest, rows, copier, way):
    placement = ColumnPlacement(width, dest, copier)
    if way != "timed":  # one way forced on every rank, whatever the timing chose
        _force(placement, way)
        assert all(placement.way(r, rows) == way for r in range(len(dest)) if dest[r])
    gen = torch.Generator().manual_seed(0)
    pieces = [torch.randn(rows * len(d) * width, generator=gen) for d in dest]
    order = _reference_order(placement)
    expected = torch.cat([p.view(rows, len(d) * width) for p, d in zip(pieces, dest)], dim=1)[:, order]
    assert torch.equal(placement.assemble(pieces, rows), expected)
    grad = torch.randn(rows, placement.blocks * width, generator=gen)
    back = torch.empty_like(grad)
    back[:, order] = grad
    expected_chunks = back.split([len(d) * width for d in dest], dim=1)
    chunks = placement.split(grad)
    assert all(torch.equal(c, e) for c, e in zip(chunks, expected_chunks))
    # back to back in one buffer, so that the all-to-all sends them without a copy
    filled = [c for c in chunks if c.numel()]
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in filled[:-1]]
    assert [c.data_ptr() for c in filled[1:]] == ends


def test_runs_and_bad_placements():
    assert arithmetic_runs([0, 2, 4, 5, 6, 3]) == [(0, 3, 0, 2), (3, 2, 5, 1), (5, 1, 3, 1)]
    with pytest.raises(ValueError, match="every output block once"):
        ColumnPlacement(2, [[0, 1], [1]])


def _force(placement: ColumnPlacement, way: str) -> None:
    """Made-up trials on every rank in which ``way`` is the fastest of the placement's ways."""
    times = tuple(0.0 if w == way else 1.0 for w in placement.ways)
    placement._trials = [((1, times),) for _ in placement.dest]
    placement._decided.clear()


def test_interpolated_times_decide_between_the_trials():
    # the first way cheaper at few rows, the second past ~190 rows
    trials = ((32, (10.0, 20.0)), (256, (30.0, 25.0)), (2048, (200.0, 100.0)))
    fastest = copy_choice.fastest
    assert [fastest(trials, rows) for rows in (1, 32, 100)] == [0, 0, 0]
    assert [fastest(trials, rows) for rows in (200, 256, 1000)] == [1, 1, 1]
    assert fastest(trials, 1 << 20) == 1  # past the last trial: the last segment extrapolated
    # a crossover inside the last segment: 20 + 100 f = 25 + 75 f at f = 0.2, 256 + 0.2 * 1792 ~ 614 rows
    late = ((32, (5.0, 9.0)), (256, (20.0, 25.0)), (2048, (120.0, 100.0)))
    assert fastest(late, 600) == 0 and fastest(late, 630) == 1 and fastest(late, 4096) == 1
    assert fastest(((2048, (1.0, 2.0)),), 1 << 16) == 0  # one trial: its comparison everywhere
    # three ways, one not allowed (the copier on non-contiguous tensors), one never timed (inf)
    three = ((32, (1.0, 3.0, 2.0)), (256, (2.0, 9.0, 4.0)))
    assert fastest(three, 100) == 0 and fastest(three, 100, [False, True, True]) == 2
    untimed = ((32, (1.0, math.inf, 2.0)), (256, (5.0, math.inf, 4.0)))
    assert fastest(untimed, 100, [False, True, True]) == 2 and fastest(untimed, 200) == 2


def test_trials_take_turns_skip_untimed_ways_and_stop_at_the_byte_limit():
    calls = []

    def make(rows):
        calls.append(("make", rows))
        return [lambda: calls.append("first"), None, lambda: calls.append("third")]

    # 256 rows of this many bytes would pass TRIAL_BYTES: only the first row count is timed
    bytes_per_row = copy_choice.TRIAL_BYTES // 200
    trials = copy_choice.time_trials(make, bytes_per_row)
    assert [t[0] for t in trials] == [copy_choice.TRIAL_ROWS[0]]
    assert calls == [("make", 32)] + ["first", "third"] * (copy_choice.TRIAL_SAMPLES + 1)
    seconds = trials[0][1]
    assert math.isfinite(seconds[0]) and seconds[1] == math.inf and math.isfinite(seconds[2])
    calls.clear()
    assert [t[0] for t in copy_choice.time_trials(make, 4)] == list(copy_choice.TRIAL_ROWS)
    # even a row too wide for the limit is timed at the first row count (a call would move it anyway)
    assert [t[0] for t in copy_choice.time_trials(make, copy_choice.TRIAL_BYTES)] == [32]


def test_each_rank_takes_the_way_its_trials_show_fastest(monkeypatch):
    monkeypatch.setattr(placement, "_TRIALS", {})
    timed, seen = [], []

    def copier(*args):
        seen.append(1)
        copy_column_ranges_torch(*args)

    def made_up(make_ways, bytes_per_row):
        ways = make_ways(4)
        for way, name in zip(ways, ("copier", "strided", "index")):
            seen.clear()
            way()
            assert len(seen) == (2 if name == "copier" else 0)  # only the copier's way calls it
        timed.append(bytes_per_row)
        # the copier fastest below ~256 rows, the index copy past it, strided never
        return ((32, (1.0, 3.0, 2.0)), (256, (2.0, 3.0, 2.0)), (2048, (9.0, 9.5, 3.0)))

    monkeypatch.setattr(placement, "time_trials", made_up)
    dest = [list(range(0, 64, 2)), list(range(1, 64, 2)), []]
    trial = ColumnPlacement(8, dest, copier)
    assert trial.ways == ("copier", "strided", "index")
    assert timed == [4 * 64 * 8] * 2  # ranks with blocks only, bytes of an fp32 output row
    assert trial.way(0, 32) == "copier" and trial.way(1, 200) == "copier" and trial.way(0, 1000) == "index"
    # not contiguous: the copier is not allowed, the fastest of the others
    assert trial.way(0, 32, copier_allowed=False) == "index"
    gen = torch.Generator().manual_seed(0)
    grad_t = torch.randn(trial.blocks * 8, 32, generator=gen).t()  # [32, 512], not contiguous
    assert trial._way_for(0, grad_t, torch.empty(32 * 256)) == "index"
    # the same layout again in this process: its trials are reused, not timed again
    again = ColumnPlacement(8, dest, copier)
    assert len(timed) == 2 and again.way(1, 64) == "copier" and again.way(1, 4096) == "index"
    # consecutive blocks merged into column ranges (source column, output column, columns)
    consecutive = ColumnPlacement(2, [[2, 3, 4], [0, 1, 5]], copier)
    assert [r[0].tolist() for r in consecutive._ranges] == [[[0, 4, 6]], [[0, 0, 4], [4, 10, 2]]]
    # without a copier: the strided and index ways only, timed too (trials of two ways here)
    monkeypatch.setattr(placement, "time_trials", lambda make, nbytes: ((32, (2.0, 1.0)),))
    plain = ColumnPlacement(2, [[2, 3, 4], [0, 1, 5]])
    assert plain.ways == ("strided", "index") and plain.way(0, 1) == "index"


def test_off_the_cpu_the_runs_decide_and_too_many_runs_are_not_timed_strided():
    many = list(range(0, 2 * (MAX_TIMED_RUNS + 1), 2))[::-1]  # descending: a run a block
    rest = [b for b in range(2 * (MAX_TIMED_RUNS + 1)) if b not in many]
    wide = ColumnPlacement(1, [many, rest])
    assert len(wide._runs[0]) > MAX_TIMED_RUNS and wide._trials[0][0][1][0] == math.inf
    assert wide.way(0, 32) == "index"  # never strided on the CPU: it was not timed
    meta = torch.empty(4, wide.blocks, device="meta")
    assert wide._way_for(0, meta, torch.empty(4 * len(many), device="meta")) == "index"
    few = ColumnPlacement(2, [[0, 2, 4], [1, 3, 5]])
    assert few._way_for(0, torch.empty(4, 12, device="meta"), torch.empty(12, device="meta")) == "strided"


@pytest.mark.parametrize("copier", COPIERS[1:])
def test_a_placement_built_under_a_meta_device_context_moves_cpu_tensors(copier):
    # a module built on the meta device first: the copier's ranges and the trials stay on the CPU
    with torch.device("meta"):
        meta_built = ColumnPlacement(4, [[0, 2], [1, 3]], copier)
    _force(meta_built, "copier")
    pieces = [torch.arange(8.0), torch.arange(8.0, 16.0)]
    expected = ColumnPlacement(4, [[0, 2], [1, 3]]).assemble(pieces, 1)
    assert torch.equal(meta_built.assemble(pieces, 1), expected)
