"""all_gather_into: the same bytes as the backend's all-gather, by point-to-point transfers on gloo
for large blocks (forced here with a threshold of 0 bytes) and by the all-gather below it; and the
sharded modules' backward (the pooled reduce-scatter's all-gather, the data-parallel replicas'
gathers) through the transfers, against the unsharded module."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.testing import run_world


def _gather_worker(threshold: int) -> dict:
    import shardkit.distributed.gather_blocks as gather_blocks

    rank, world = dist.get_rank(), dist.get_world_size()
    gather_blocks.P2P_MIN_BYTES = threshold
    calls = []
    backend_gather = gather_blocks._all_gather_flat
    gather_blocks._all_gather_flat = lambda *a, **k: calls.append(1) or backend_gather(*a, **k)
    checked = 0
    for dtype in (torch.uint8, torch.float32, torch.int64):
        for n in (1, 5, 1000):
            gen = torch.Generator().manual_seed(7 * rank + n)
            send = (torch.randn(n, generator=gen) * 100).to(dtype)
            want = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(want, send)
            for async_op in (False, True):
                out = torch.full((world * n,), 3, dtype=dtype)
                work = gather_blocks.all_gather_into(out, send, async_op=async_op)
                if async_op:
                    work.wait()
                else:
                    assert work is None
                assert torch.equal(out, want), (dtype, n, async_op)
                # this rank's block already in place (send is a view of out): nothing is copied over it
                inplace = torch.zeros(world * n, dtype=dtype)
                inplace[rank * n : (rank + 1) * n] = send
                gather_blocks.all_gather_into(inplace, inplace[rank * n : (rank + 1) * n])
                assert torch.equal(inplace, want), (dtype, n, "in place")
                checked += 1
    with pytest.raises(ValueError, match="not 2 x 3|not 3 x 3|not 4 x 3|not 1 x 3"):
        gather_blocks.all_gather_into(torch.empty(world * 3 + 1), torch.empty(3))
    return {"checked": checked, "backend_calls": len(calls)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_transfers_give_the_backends_all_gather(world):
    for rank_result in run_world(_gather_worker, world, 0):
        assert rank_result["checked"] == 18
        # world 1: the backend's own (trivial) gather; otherwise every gather went point to point
        assert rank_result["backend_calls"] == (36 if world == 1 else 0)


def test_small_blocks_take_the_backends_all_gather():
    for rank_result in run_world(_gather_worker, 2, 1 << 20):
        assert rank_result["backend_calls"] == 36


def _sharded_worker() -> bool:
    import shardkit.distributed.gather_blocks as gather_blocks
    from shardkit.modules import OptimType
    from tests.sharding.test_sharded_embedding_bag_collection import _check_exact

    gather_blocks.P2P_MIN_BYTES = 0  # every all-gather of the step's gradients point to point
    calls = []
    backend_gather = gather_blocks._all_gather_flat
    gather_blocks._all_gather_flat = lambda *a, **k: calls.append(1) or backend_gather(*a, **k)
    transfers = []
    isend = gather_blocks.dist.isend
    gather_blocks.dist.isend = lambda *a, **k: transfers.append(1) or isend(*a, **k)
    for optimizer in (OptimType.SGD, OptimType.ADAGRAD):
        for weighted in (False, True):
            _check_exact(optimizer, weighted)
    assert not calls and transfers  # the row-wise backward's all-gather took the transfers
    return True


@pytest.mark.parametrize("world_size, local_size", [(2, None), (3, None), (4, 2)])
def test_sharded_modules_match_unsharded_with_point_to_point_gathers(world_size, local_size):
    assert all(run_world(_sharded_worker, world_size, local_world_size=local_size))
