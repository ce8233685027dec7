"""ColumnPlacement: the received blocks put in place (and the gradient split back) exactly as the
concatenation in rank order followed by the column permutation, for strided runs and for the
index fallback of an irregular placement, and with a column-range copier (the native one and its
pure-torch twin) where it takes over; the choice between the two ways follows their timed trials
(``copy_choice``; no timings are checked here: trials are made up where a choice is asserted)."""

from __future__ import annotations

import pytest
import torch

from shardkit.distributed.comm_ops import copy_choice, placement
from shardkit.distributed.comm_ops.placement import MAX_RUNS, ColumnPlacement, arithmetic_runs
from shardkit.kernels.column_copy import column_copier, copy_column_ranges_torch

# None: the strided copies and the index fallback; the twin; the native op where it is built
COPIERS = [None, copy_column_ranges_torch] + ([column_copier()] if column_copier() is not None else [])


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
        # more runs than MAX_RUNS on rank 0: the index fallback
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
@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("way", ["timed", "copier", "strided"])
def test_assemble_and_split_are_cat_and_permute(width, dest, rows, copier, way):
    placement = ColumnPlacement(width, dest, copier)
    if copier is not None and way != "timed":  # each way forced on every rank, whatever the timing chose
        _force(placement, copier=way == "copier")
        assert all(placement.uses_copier(r, rows) == (way == "copier") for r in range(len(dest)) if dest[r])
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


def _force(placement: ColumnPlacement, copier: bool) -> None:
    """Made-up trials on every rank in which ``copier`` says which way is faster."""
    placement._trials = [((1, 0.0, 1.0) if copier else (1, 1.0, 0.0),) for _ in placement.dest]
    placement._decided.clear()


def test_interpolated_times_decide_between_the_trials():
    # the copier (first) cheaper at few rows, the strided copies (second) past ~190 rows
    trials = ((32, 10.0, 20.0), (256, 30.0, 25.0), (2048, 200.0, 100.0))
    faster = copy_choice.first_is_faster
    assert faster(trials, 1) and faster(trials, 32) and faster(trials, 100)
    assert not faster(trials, 200) and not faster(trials, 256) and not faster(trials, 1000)
    assert not faster(trials, 1 << 20)  # past the last trial: the last segment extrapolated
    # a crossover inside the last segment: 20 + 100 f = 25 + 75 f at f = 0.2, 256 + 0.2 * 1792 ~ 614 rows
    late = ((32, 5.0, 9.0), (256, 20.0, 25.0), (2048, 120.0, 100.0))
    assert faster(late, 600) and not faster(late, 630) and not faster(late, 4096)
    assert faster(((2048, 1.0, 2.0),), 1 << 16)  # one trial: its comparison everywhere


def test_trials_alternate_the_ways_and_stop_at_the_byte_limit():
    calls = []

    def make(rows):
        calls.append(("make", rows))
        return (lambda: calls.append("first"), lambda: calls.append("second"))

    # 256 rows of this many bytes would pass TRIAL_BYTES: only the first row count is timed
    bytes_per_row = copy_choice.TRIAL_BYTES // 200
    trials = copy_choice.time_trials(make, bytes_per_row)
    assert [t[0] for t in trials] == [copy_choice.TRIAL_ROWS[0]]
    assert calls == [("make", 32)] + ["first", "second"] * (copy_choice.TRIAL_SAMPLES + 1)
    assert all(isinstance(s, float) and s >= 0 for t in trials for s in t[1:])
    calls.clear()
    assert [t[0] for t in copy_choice.time_trials(make, 4)] == list(copy_choice.TRIAL_ROWS)
    # even a row too wide for the limit is timed at the first row count (a call would move it anyway)
    assert [t[0] for t in copy_choice.time_trials(make, copy_choice.TRIAL_BYTES)] == [32]


def test_the_copier_moves_what_its_trials_show_it_moves_faster(monkeypatch):
    monkeypatch.setattr(placement, "_TRIALS", {})
    timed, seen = [], []

    def copier(*args):
        seen.append(1)
        copy_column_ranges_torch(*args)

    def made_up(make_ways, bytes_per_row):
        copied, strided = make_ways(4)
        seen.clear()
        strided()
        assert not seen  # the second way is the strided one
        copied()
        assert seen == [1, 1]  # and the first the copier's (a place and a take)
        timed.append(bytes_per_row)
        # the copier faster below 256 rows on every rank
        return ((32, 1.0, 2.0), (256, 2.0, 2.0), (2048, 9.0, 3.0))

    monkeypatch.setattr(placement, "time_trials", made_up)
    trial = ColumnPlacement(8, [list(range(0, 64, 2)), list(range(1, 64, 2)), []], copier)
    assert timed == [4 * 64 * 8] * 2  # ranks with blocks only, bytes of an fp32 output row
    assert trial.uses_copier(0, 32) and trial.uses_copier(1, 200) and not trial.uses_copier(0, 256)
    assert not trial.uses_copier(2, 1)  # nothing to move, no trials
    # the same layout again in this process: its trials are reused, not timed again
    again = ColumnPlacement(8, [list(range(0, 64, 2)), list(range(1, 64, 2)), []], copier)
    assert len(timed) == 2 and again.uses_copier(1, 64) and not again.uses_copier(1, 4096)
    # consecutive blocks merged into column ranges (source column, output column, columns)
    consecutive = ColumnPlacement(2, [[2, 3, 4], [0, 1, 5]], copier)
    assert [r[0].tolist() for r in consecutive._ranges] == [[[0, 4, 6]], [[0, 0, 4], [4, 10, 2]]]
    # without a copier: never, and nothing is timed
    assert not ColumnPlacement(2, [[2, 3, 4], [0, 1, 5]]).uses_copier(0, 1) and len(timed) == 4


@pytest.mark.parametrize("copier", COPIERS[1:])
def test_a_placement_built_under_a_meta_device_context_moves_cpu_tensors(copier):
    # a module built on the meta device first: the copier's ranges and the trials stay on the CPU
    with torch.device("meta"):
        meta_built = ColumnPlacement(4, [[0, 2], [1, 3]], copier)
    _force(meta_built, copier=True)
    pieces = [torch.arange(8.0), torch.arange(8.0, 16.0)]
    expected = ColumnPlacement(4, [[0, 2], [1, 3]]).assemble(pieces, 1)
    assert torch.equal(meta_built.assemble(pieces, 1), expected)
