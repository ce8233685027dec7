"""The data-parallel replicas' sort-free gradient scatter (``kernels/replica_grad.py``): the native
op against its pure-torch twin and against the fused backward's sums it replaces.

Bounds: bitwise equal to the twin (whose sums are the fused backward's, an SGD step of ``lr =
-factor`` into zeros) for a factor that is a power of two, with or without per-sample weights, bag
scales, bag shifts, a sample-major gradient or a position map; every target not touched is zeroed,
whatever the output held before.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.kernels import kernel_backend, native_enabled_by_env
from shardkit.kernels.replica_grad import grad_scatter, touched_rows

needs_native = pytest.mark.skipif(
    not native_enabled_by_env(), reason="SHARDKIT_NATIVE=0: the native kernels are switched off"
)
ROWS, BAGS = 200, 48


def _lookup(id_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (BAGS,), generator=gen)
    lengths[3] = 0  # an empty bag
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    # rows 0..99 of each bag's half: repeats within and across bags, rows 100.. partly untouched
    ids = torch.randint(0, ROWS // 2, (int(lengths.sum()),), generator=gen).to(id_dtype)
    shift = torch.randint(0, ROWS // 4, (BAGS,), generator=gen)
    psw = torch.rand(ids.numel(), generator=gen) + 0.5
    scale = 1.0 / lengths.clamp(min=1).to(torch.float32)
    return ids, offsets, shift, psw, scale


def _scatter(backend, targets, dim, args, factor, position=None, num_rows=None, garbage=True):
    out = torch.full((targets, dim), float("nan")) if garbage else torch.zeros(targets, dim)
    seen = torch.zeros(targets)
    with kernel_backend(backend):
        count = grad_scatter(out, seen, *args, factor, position, num_rows)
    return out, seen, count


@needs_native
@pytest.mark.parametrize("dim", [8, 5, 64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("batch_major", [0, 8])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_native_scatter_sums_like_the_twin(dim, weighted, batch_major, id_dtype):
    ids, offsets, shift, psw, scale = _lookup(id_dtype)
    grad = torch.randn(BAGS, dim)
    if batch_major:  # the KeyedTensor layout: sample-major [S, F * dim]
        grad = grad.view(BAGS // batch_major, batch_major, dim).transpose(0, 1).reshape(batch_major, -1)
    psw, scale = (psw, scale) if weighted else (None, None)
    for factor in (1.0, 0.5, 0.25):
        args = (ids, offsets, shift, psw, scale, grad, True, batch_major)
        got, seen, count = _scatter("native", ROWS, dim, args, factor)
        want, want_seen, want_count = _scatter("torch", ROWS, dim, args, factor)
        assert torch.equal(got, want), (got - want).abs().max()
        assert torch.equal(seen, want_seen) and count == want_count == int(want_seen.sum())
        assert 0 < count < ROWS  # some rows untouched: their NaN rows must have been zeroed


@needs_native
def test_native_scatter_without_pooling_reads_one_gradient_row_per_id():
    ids, offsets, shift, psw, scale = _lookup(torch.int64, seed=1)
    grad = torch.randn(ids.numel(), 16)
    args = (ids, offsets, shift, psw, scale, grad, False, 0)  # weights and scale unused
    got, seen, count = _scatter("native", ROWS, 16, args, 0.5)
    want, want_seen, want_count = _scatter("torch", ROWS, 16, args, 0.5)
    assert torch.equal(got, want) and torch.equal(seen, want_seen) and count == want_count


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "torch"])
@pytest.mark.parametrize("pooled, batch_major", [(True, 0), (True, 8), (False, 0)])
@pytest.mark.parametrize("weighted", [False, True])
def test_scatter_reads_a_column_slice_of_a_wider_gradient_in_place(backend, pooled, batch_major, weighted):
    # several lookup groups' gradients side by side (modules.fused_groups): each group's columns are
    # read where they are, with the same sums as from a contiguous copy
    ids, offsets, shift, psw, scale = _lookup(torch.int64, seed=2)
    dim = 16
    rows, cols = (
        (batch_major, BAGS // batch_major * dim) if batch_major else (BAGS if pooled else ids.numel(), dim)
    )
    wide = torch.randn(rows, cols + 7, generator=torch.Generator().manual_seed(3))
    grad = wide[:, 4 : 4 + cols]
    psw, scale = (psw, scale) if weighted else (None, None)
    results = []
    for g in (grad.contiguous(), grad):
        args = (ids, offsets, shift, psw, scale, g, pooled, batch_major)
        results.append(_scatter(backend, ROWS, dim, args, 0.5))
    (got, seen, count), (want, want_seen, want_count) = results[1], results[0]
    assert torch.equal(got, want) and torch.equal(seen, want_seen) and count == want_count > 0


@needs_native
def test_native_touched_rows_and_positions_match_the_twin_and_leave_the_marks_clear():
    ids, offsets, shift, _, _ = _lookup(torch.int64, seed=2)
    results = []
    for backend in ("native", "torch"):
        marks = torch.zeros(ROWS, dtype=torch.bool)
        position = torch.full((ROWS,), -1, dtype=torch.int64)
        with kernel_backend(backend):
            rows = touched_rows(marks, position, ids, offsets, shift)
        assert not marks.any()  # the kept scratch is clear again for the next backward
        results.append((rows, position))
    (rows, position), (want_rows, want_position) = results
    assert torch.equal(rows, want_rows) and torch.equal(position, want_position)
    all_rows = ids + torch.repeat_interleave(shift, offsets.diff())
    assert torch.equal(rows, torch.unique(all_rows))
    assert torch.equal(position[rows], torch.arange(rows.numel()))


@needs_native
@pytest.mark.parametrize("rows", [1, 31, 32, 33, 1000, 4099])
def test_native_touched_rows_of_sparse_marks_over_many_rows(rows):
    """A few ids over many rows: the first and last rows, rows at and beside the 32-byte spans' edges,
    repeats, a tail that is not a whole span. The native op sorts its list of the rows at 1 row and at
    4099 (10 rows: sparse enough, ``sort_beats_read``) and reads the marks back, skipping unmarked
    spans, at 31-1000 rows."""
    picks = [0, rows - 1, 31, 32, 33, 63, 64, rows // 2, rows - 33, 5, 5, rows - 1]
    ids = torch.tensor([p for p in picks if 0 <= p < rows], dtype=torch.int64)
    offsets = torch.tensor([0, ids.numel() // 2, ids.numel()], dtype=torch.int64)
    marks = torch.zeros(rows, dtype=torch.bool)
    position = torch.full((rows,), -1, dtype=torch.int64)
    with kernel_backend("native"):
        got = touched_rows(marks, position, ids, offsets, None)
    assert not marks.any()
    assert torch.equal(got, torch.unique(ids))
    assert torch.equal(position[got], torch.arange(got.numel()))


@needs_native
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_scatter_into_the_touched_rows_by_their_positions(backend):
    """The sparse exchange's form: targets are the touched rows' positions, every one touched."""
    ids, offsets, shift, psw, scale = _lookup(torch.int64, seed=3)
    grad = torch.randn(BAGS, 8)
    marks = torch.zeros(ROWS, dtype=torch.bool)
    position = torch.empty(ROWS, dtype=torch.int64)
    with kernel_backend(backend):
        rows = touched_rows(marks, position, ids, offsets, shift)
    args = (ids, offsets, shift, psw, scale, grad, True, 0)
    got, seen, count = _scatter(backend, rows.numel(), 8, args, 0.5, position, ROWS)
    full, _, _ = _scatter("torch", ROWS, 8, args, 0.5)
    assert count == rows.numel() and bool(seen.all())
    assert torch.equal(got, full[rows])


@needs_native
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_a_row_outside_the_buffer_raises_before_anything_is_written(backend):
    ids, offsets, shift, _, _ = _lookup(torch.int64, seed=4)
    ids[5] = ROWS  # plus its shift: past the last row
    out, seen = torch.zeros(ROWS, 4), torch.zeros(ROWS)
    marks = torch.zeros(ROWS, dtype=torch.bool)
    with kernel_backend(backend), pytest.raises(IndexError):
        grad_scatter(out, seen, ids, offsets, shift, None, None, torch.ones(BAGS, 4), True, 0, 1.0)
    with kernel_backend(backend), pytest.raises(IndexError):
        touched_rows(marks, torch.empty(ROWS, dtype=torch.int64), ids, offsets, shift)
    assert not seen.any() and not marks.any()


@needs_native
def test_native_scatter_on_several_threads_sums_each_row_as_on_one():
    """Threads own ranges of buffer rows: each row is summed by one thread, in id order."""
    rows, bags, dim = 20000, 512, 8
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 30, (bags,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    grad = torch.randn(bags, dim, generator=gen)
    args = (ids, offsets, None, None, None, grad, True, 0)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            results.append(_scatter("native", rows, dim, args, 0.5))
    finally:
        torch.set_num_threads(threads)
    (one, seen_one, count_one), (many, seen_many, count_many) = results
    assert torch.equal(one, many) and torch.equal(seen_one, seen_many) and count_one == count_many
    want, _, _ = _scatter("torch", rows, dim, args, 0.5)
    assert torch.equal(many, want)
