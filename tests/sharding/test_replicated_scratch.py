"""The sparse exchange of a FUSED data-parallel table in the kept exchange buffer (``uses_scratch``).

A table whose buffer fits ``SCRATCH_LIMIT_BYTES`` finds its touched rows from the buffer's flags
(no ``torch.unique``) and adds the gathered rows in place; a larger one sorts its touched rows. Both
must take the unsharded module's step on the global batch and keep the replicas bitwise equal, for
any world size (the rank-order sum of three ranks, the division by a world that is not a power of
two) and any width (an odd one packs rows at odd offsets of the wire buffer).
"""

import pytest

from shardkit.sharding.replicated_exchange import SCRATCH_LIMIT_BYTES, uses_scratch


def test_uses_scratch_while_the_exchange_buffer_fits_the_limit():
    rows = SCRATCH_LIMIT_BYTES // 4 // 9  # dim 8: 9 words a row, plus one count per rank
    assert uses_scratch(rows - 1, 8, 2)
    assert not uses_scratch(rows + 1, 8, 2)
    assert uses_scratch(1000, 16, 2) and not uses_scratch(10**8, 16, 2)


def _train_worker(rows, dim, steps, limit):
    """Train a fused data-parallel table of ``rows x dim`` (row-wise Adagrad) beside the unsharded one
    on the global batch for ``steps`` random steps of 2 bags per rank (some empty). Returns this
    rank's table, the reference's, how many backwards sorted their touched rows, the most rows of a
    buffer this rank's gradient was summed into, and whether a dense exchange buffer was made."""
    import torch
    import torch.distributed as dist

    import shardkit.sharding.replicated_exchange as exchange
    import shardkit.sharding.replicated_fused_lookup as fused
    from shardkit.modules import OptimType
    from shardkit.sparse import KeyedJaggedTensor
    from tests.sharding._replicated_case import reference_and_replica

    if limit is not None:
        exchange.SCRATCH_LIMIT_BYTES = limit
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded = reference_and_replica(rows, dim, OptimType.ROWWISE_ADAGRAD)
    sorted_calls, targets = [], []
    sorted_rows = fused._sorted_rows
    fused._sorted_rows = lambda *a: sorted_calls.append(1) or sorted_rows(*a)
    # the rows of every buffer this rank's gradient is summed into (the sorted way, the scatter)
    accumulate, scatter = fused._accumulate, fused.grad_scatter
    fused._accumulate = lambda buffer, *a, **k: targets.append(buffer.size(0)) or accumulate(buffer, *a, **k)
    fused.grad_scatter = lambda buffer, *a, **k: targets.append(buffer.size(0)) or scatter(buffer, *a, **k)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        lengths = torch.randint(0, 4, (world, 2), generator=gen)
        ids = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        grad = torch.randn(2 * world, dim, generator=gen)
        whole = KeyedJaggedTensor(["f"], ids, lengths=lengths.view(-1))
        (reference(whole).values() * grad).sum().div(world).backward()
        start = int(lengths[:rank].sum())
        mine = ids[start : start + int(lengths[rank].sum())]
        out = sharded(KeyedJaggedTensor(["f"], mine, lengths=lengths[rank])).values()
        (out * grad[2 * rank : 2 * rank + 2]).sum().backward()
    got = sharded.local_shards()[("d", 0, rows, 0, dim)].clone()
    dense = [
        m._dense_exchange.buffer is not None
        for m in sharded.modules()
        if isinstance(m, fused.ReplicatedFusedLookup) and m._dense_exchange is not None
    ]
    return got, reference.table_weight("d").detach().clone(), len(sorted_calls), max(targets), any(dense)


@pytest.mark.parametrize(
    "world, dim, limit",
    [(2, 5, None), (3, 8, None), (3, 5, None), (3, 5, 0)],
    ids=["2ranks-dim5", "3ranks-dim8", "3ranks-dim5", "3ranks-dim5-over-limit"],
)
def test_sparse_exchange_trains_like_the_unsharded_module(world, dim, limit):
    import torch

    from shardkit.testing import run_world

    steps = 6
    results = run_world(_train_worker, world, 64, dim, steps, limit)
    for got, want, sorted_calls, target_rows, dense_buffer in results:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        # in the kept buffer no backward sorts its touched rows; over the limit every one does
        assert sorted_calls == (steps if limit == 0 else 0), sorted_calls
        # either way the gradient is summed into a block of the touched rows (at most 2 bags of 3
        # ids a rank), never into a buffer of the table's 64 rows
        assert target_rows <= 6, target_rows
        assert not dense_buffer  # every step took the sparse way: no table-sized buffer was made
    for got, *_ in results[1:]:
        assert torch.equal(got, results[0][0]), "the replicas differ"


@pytest.mark.parametrize("world, dim", [(2, 128), (3, 5)], ids=["2ranks-dim128", "3ranks-dim5"])
def test_the_sorted_way_trains_bitwise_like_the_scratch_way(world, dim):
    """Both ways gather into the kept wire buffer and step the gathered rows in rank order: the same
    tables bit for bit (and, on 2 ranks, where the division by the world is exact, the unsharded
    module's)."""
    import torch

    from shardkit.testing import run_world

    sorted_way = run_world(_train_worker, world, 64, dim, 6, 0)
    scratch_way = run_world(_train_worker, world, 64, dim, 6, None)
    assert [r[2] for r in sorted_way] == [6] * world and [r[2] for r in scratch_way] == [0] * world
    for (got, want, *_), (other, *_) in zip(sorted_way, scratch_way):
        assert torch.equal(got, other)
        if world == 2:
            assert torch.equal(got, want)


def _blocks_worker():
    """Each rank fills its block of 5 int32 words; returns what every rank holds after
    ``all_gather_blocks`` and how many all-gathers it ran."""
    import torch
    import torch.distributed as dist

    import shardkit.sharding.replicated_exchange as exchange

    calls = []
    flat = exchange.all_gather_flat
    exchange.all_gather_flat = lambda *a, **k: calls.append(1) or flat(*a, **k)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.full((world * 5,), -1, dtype=torch.int32)
    out[rank * 5 : (rank + 1) * 5] = torch.arange(5, dtype=torch.int32) + 10 * rank
    exchange.all_gather_blocks(out, None)
    return out, len(calls)


def test_blocks_reach_every_rank_point_to_point_on_gloo():
    import torch

    from shardkit.testing import run_world

    want = (torch.arange(5) + 10 * torch.arange(3)[:, None]).view(-1).to(torch.int32)
    for out, all_gathers in run_world(_blocks_worker, 3):
        assert torch.equal(out, want), out
        assert all_gathers == 0  # gloo: sends and receives, not its (slower) all-gather


def test_touched_rows_are_read_off_the_kept_marks_with_their_positions():
    import torch

    from shardkit.sharding.replicated_exchange import DenseRowExchange

    exchange = DenseRowExchange(10, 2, 2, torch.device("cpu"))
    ids, offsets = torch.tensor([7, 2, 2, 5]), torch.tensor([0, 1, 4])
    rows = exchange.touched(ids, offsets, None)
    assert rows.tolist() == [2, 5, 7] and exchange.position[rows].tolist() == [0, 1, 2]
    assert not exchange.marks.any()  # clear again: no memset before the next backward
    # kept across backwards: another step's rows renumber from scratch
    rows = exchange.touched(torch.tensor([9, 5]), torch.tensor([0, 2]), None)
    assert rows.tolist() == [5, 9] and exchange.position[rows].tolist() == [0, 1]


def test_dense_exchange_on_three_ranks_trains_like_the_unsharded_module():
    """A 4-row table that every step mostly touches: the dense way, whose gradient is scattered
    without a memset and divided by a world (3) that is not a power of two."""
    import torch

    from shardkit.testing import run_world

    results = run_world(_train_worker, 3, 4, 5, 6, None)
    for got, want, _, target_rows, dense_buffer in results:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert dense_buffer and target_rows == 4  # summed into the table-sized dense buffer
    for got, *_ in results[1:]:
        assert torch.equal(got, results[0][0]), "the replicas differ"


def _wire_worker():
    """Gathers of 2 ranks sized for 8, 8, 9, 100, 40 and 2 rows per rank (dim 4): the wire buffer's
    size after each, and whether each gather reused the buffer before it."""
    import torch

    from shardkit.sharding.replicated_exchange import DenseRowExchange

    exchange = DenseRowExchange(1000, 4, 2, torch.device("cpu"))
    rows = torch.tensor([3, 7], dtype=torch.int64)
    sizes, reused = [], []
    for most in (8, 8, 9, 100, 40, 2):
        before = exchange._wire.data_ptr()
        counts = exchange.gather(rows, most, None, lambda out: out.fill_(1.0))
        assert counts == [2, 2]
        sizes.append(exchange._wire.numel())
        reused.append(exchange._wire.data_ptr() == before)
    return sizes, reused


def test_the_wire_buffer_is_kept_grown_and_remade_after_a_large_drop():
    from shardkit.sharding.replicated_exchange import WIRE_SHRINK
    from shardkit.testing import run_world

    for sizes, reused in run_world(_wire_worker, 2):
        # kept while it fits (8 rows, then 8 again)
        assert reused[1] and sizes[1] == sizes[0]
        assert sizes[3] > sizes[2] and not reused[3]  # grown for 100 rows
        # 40 rows need more than 1 / WIRE_SHRINK of the 100 rows' buffer: kept
        assert reused[4] and sizes[4] == sizes[3]
        assert sizes[3] > WIRE_SHRINK * sizes[5] and not reused[5]  # 2 rows: remade smaller
