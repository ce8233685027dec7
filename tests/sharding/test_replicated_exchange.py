"""The FUSED data-parallel replicas' backward: which exchange each step takes, and what it runs.

The replicas must take the unsharded module's step on the global batch whichever exchange a step
takes (sparse gathers or the dense all-reduce), stay bitwise equal to each other, and, once the last
exchange said most rows are touched, skip the counts gather; the rows' gradient comes from the kernel
backend's fused backward, not from torch autograd re-running the lookup.
"""

import pytest

from shardkit.modules import OptimType


def _steps_worker(optimizer, rows, steps):
    """Train a fused data-parallel table of ``rows x 8`` on ``steps`` (each: per rank, (ids, lengths)
    of 2 bags) beside the unsharded module on the global batch. Returns, per step, the sizes of the
    backward's collectives; the calls of torch.autograd.grad; this rank's table and the reference's."""
    import torch
    import torch.distributed as dist

    import shardkit.sharding.replicated_exchange as exchange
    from shardkit.sparse import KeyedJaggedTensor
    from tests.sharding._replicated_case import reference_and_replica

    rank, dim = dist.get_rank(), 8
    reference, sharded = reference_and_replica(rows, dim, optimizer)
    sizes, grads = [], []

    def recording(collective):
        def run(out, *args, **kwargs):
            sizes[-1].append(out.numel())
            return collective(out, *args, **kwargs)

        return run

    exchange.all_gather_flat = recording(exchange.all_gather_flat)
    exchange.all_gather_blocks = recording(exchange.all_gather_blocks)
    exchange.all_reduce_sum = recording(exchange.all_reduce_sum)
    autograd_grad = torch.autograd.grad
    torch.autograd.grad = lambda *a, **k: grads.append(1) or autograd_grad(*a, **k)
    grad = torch.arange(4 * dim, dtype=torch.float32).view(4, dim).sin()
    for step in steps:
        ids = [torch.tensor(i, dtype=torch.int64) for i, _ in step]
        lengths = [torch.tensor(n, dtype=torch.int64) for _, n in step]
        whole = KeyedJaggedTensor(["f"], torch.cat(ids), lengths=torch.cat(lengths))
        (reference(whole).values() * grad).sum().div(2).backward()
        sizes.append([])
        out = sharded(KeyedJaggedTensor(["f"], ids[rank], lengths=lengths[rank])).values()
        (out * grad[2 * rank : 2 * rank + 2]).sum().backward()
    got = sharded.local_shards()[("d", 0, rows, 0, dim)].clone()
    return sizes, len(grads), got, reference.table_weight("d").detach().clone()


def _run(optimizer, rows, steps):
    import torch

    from shardkit.testing import run_world

    results = run_world(_steps_worker, 2, optimizer, rows, steps)
    for _, _, got, want in results:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0][2], results[1][2]), "the replicas differ"
    return results


# 16 rows: every step below touches most of them (the dense exchange), or 2 of them (the sparse one)
_MOST = [([0, 1, 2, 3, 4, 5, 6, 7, 3], [4, 5]), ([8, 9, 10, 11, 12, 13, 14, 15], [6, 2])]
_FEW = [([1, 1], [1, 1]), ([1], [0, 1])]


@pytest.mark.parametrize("optimizer", [OptimType.SGD, OptimType.ROWWISE_ADAGRAD, OptimType.ADAM])
def test_after_a_dense_exchange_the_next_backward_skips_the_counts_gather(optimizer):
    dense = 16 * (8 + 1) + 2  # the gradient, a flag per row, a count per rank
    for sizes, _, _, _ in _run(optimizer, 16, [_MOST, _MOST, _MOST, _FEW, _FEW, _MOST]):
        assert sizes[0] == [2, dense], sizes  # no last exchange yet: the counts say dense
        assert sizes[1] == [dense] and sizes[2] == [dense], sizes  # the last counts said dense
        # back to few rows: this dense exchange's counts send the next backward the sparse way, with
        # room for gather_bound([1, 1]) = 2 rows a rank in its one all-gather (no counts gather):
        # per rank 1 head block (count + 2 rows as int64 in 6 of its 8 words) + 2 gradient rows
        assert sizes[3] == [dense], sizes
        assert sizes[4] == [2 * (1 + 2) * 8], sizes
        # most rows again: the counts ride in that gather and say dense
        assert sizes[5] == [2 * (1 + 2) * 8, dense], sizes


def test_a_sparse_backward_sends_its_count_with_its_rows_and_gathers_again_when_it_outgrows_the_room():
    # per rank, for room for m rows: head blocks of 8 words holding the count and m rows as int64
    # (2 + 2m words), then m gradient rows of 8 words
    def gathered(m):
        return 2 * (-(-(2 + 2 * m) // 8) + m) * 8

    some = ([1, 2, 3], [2, 1]), ([4, 5, 6], [1, 2])  # 3 rows a rank: still the sparse way
    for sizes, _, _, _ in _run(OptimType.ADAGRAD, 16, [_FEW, _FEW, some, _FEW]):
        assert sizes[0] == [2, gathered(1)], sizes  # no exchange yet: the counts first
        assert sizes[1] == [gathered(2)], sizes  # room for gather_bound([1, 1]) = 2: one collective
        assert sizes[2] == [gathered(2), gathered(3)], sizes  # 3 > 2: again, sized to fit
        assert sizes[3] == [gathered(4)], sizes  # gather_bound([3, 3]) = 4


def test_the_rows_gradient_comes_from_the_kernel_not_from_autograd():
    for _, autograd_calls, _, _ in _run(OptimType.ADAGRAD, 16, [_FEW, _MOST, _MOST]):
        assert autograd_calls == 0


def _sorted_sums_worker(steps):
    """Train a fused data-parallel table of 16 x 8 (Adagrad) on ``steps`` beside the unsharded module;
    returns how many times the backward summed this rank's gradient with the sorting fused backward
    (``replicated_fused_lookup._accumulate``), and this rank's table and the reference's."""
    import torch
    import torch.distributed as dist

    import shardkit.sharding.replicated_fused_lookup as fused
    from shardkit.sparse import KeyedJaggedTensor
    from tests.sharding._replicated_case import reference_and_replica

    rank, dim = dist.get_rank(), 8
    reference, sharded = reference_and_replica(16, dim, OptimType.ADAGRAD)
    sorted_sums = []
    accumulate = fused._accumulate
    fused._accumulate = lambda *a, **k: sorted_sums.append(1) or accumulate(*a, **k)
    grad = torch.arange(4 * dim, dtype=torch.float32).view(4, dim).sin()
    for step in steps:
        ids = [torch.tensor(i, dtype=torch.int64) for i, _ in step]
        lengths = [torch.tensor(n, dtype=torch.int64) for _, n in step]
        whole = KeyedJaggedTensor(["f"], torch.cat(ids), lengths=torch.cat(lengths))
        (reference(whole).values() * grad).sum().div(2).backward()
        out = sharded(KeyedJaggedTensor(["f"], ids[rank], lengths=lengths[rank])).values()
        (out * grad[2 * rank : 2 * rank + 2]).sum().backward()
    got = sharded.local_shards()[("d", 0, 16, 0, dim)].clone()
    return len(sorted_sums), got, reference.table_weight("d").detach().clone()


def test_the_kept_buffer_ways_sum_the_gradient_by_a_scatter_not_the_sorting_fused_backward():
    """Dense and sparse backwards of a table that fits its kept exchange buffer: this rank's gradient
    is scattered in id order (``kernels.replica_grad``), never summed by the fused backward's sort
    of the ids; the step is still the unsharded module's."""
    import torch

    from shardkit.testing import run_world

    results = run_world(_sorted_sums_worker, 2, [_MOST, _MOST, _FEW, _MOST, _FEW, _FEW])
    for sorted_sums, got, want in results:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert sorted_sums == 0
    assert torch.equal(results[0][1], results[1][1]), "the replicas differ"


def _shm_worker(optimizer, shm):
    """``_steps_worker``'s dense steps with the shared-memory exchange ``shm`` on or off: this rank's
    table, the reference's, its gloo all-reduces and its shared-memory calls."""
    import torch.distributed as dist

    import shardkit.sharding.replicated_exchange as exchange
    from shardkit.distributed import shm_exchange

    gloo, sums = [], []
    all_reduce = exchange.dist.all_reduce
    exchange.dist.all_reduce = lambda *a, **k: gloo.append(1) or all_reduce(*a, **k)
    shm_sum = shm_exchange.SharedMemoryExchange.all_reduce_sum
    shm_exchange.SharedMemoryExchange.all_reduce_sum = lambda *a, **k: sums.append(1) or shm_sum(*a, **k)
    shm_exchange.set_shm_exchange(shm)
    try:
        _, _, got, want = _steps_worker(optimizer, 16, [_MOST, _MOST, _FEW, _MOST])
        dist.barrier()
        return got, want, len(gloo), len(sums)
    finally:
        exchange.dist.all_reduce = all_reduce
        shm_exchange.SharedMemoryExchange.all_reduce_sum = shm_sum
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


@pytest.mark.parametrize("optimizer", [OptimType.ADAGRAD, OptimType.ROWWISE_ADAGRAD])
def test_with_the_shared_memory_exchange_the_dense_way_skips_gloo_and_trains_bitwise_the_same(optimizer):
    import torch

    from shardkit.testing import run_world

    on, off = run_world(_shm_worker, 2, optimizer, True), run_world(_shm_worker, 2, optimizer, False)
    for (got, want, gloo, calls), (got_off, _, gloo_off, calls_off) in zip(on, off):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(got, got_off)
        # 4 dense exchanges: _FEW follows a dense one, the last _MOST finds most rows in its gather
        assert (gloo, gloo_off) == (0, 4) and calls == 4 and calls_off == 0
    assert torch.equal(on[0][0], on[1][0]), "the replicas differ"
