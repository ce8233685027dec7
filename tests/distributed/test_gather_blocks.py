"""all_gather_into: the same bytes as the backend's all-gather, through the shared-memory exchange
(the default on one host), and with it off by point-to-point transfers on gloo for large blocks
(forced here with a threshold of 0 bytes) and by the all-gather below it; and the sharded modules'
backward (the pooled reduce-scatter's all-gather, the data-parallel replicas' gathers) through the
transfers, against the unsharded module."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed import shm_exchange
from shardkit.testing import run_world


@contextlib.contextmanager
def _patched(threshold=None):
    """Count the backend all-gathers and the point-to-point sends (and set ``P2P_MIN_BYTES`` when
    given) for the duration, then restore the module: the test workers are reused between tests."""
    import shardkit.distributed.gather_blocks as gather_blocks

    saved = gather_blocks.P2P_MIN_BYTES, gather_blocks.all_gather_flat, gather_blocks.dist.isend
    counts = {"backend": 0, "isend": 0}

    def backend(*args, **kwargs):
        counts["backend"] += 1
        return saved[1](*args, **kwargs)

    def isend(*args, **kwargs):
        counts["isend"] += 1
        return saved[2](*args, **kwargs)

    if threshold is not None:
        gather_blocks.P2P_MIN_BYTES = threshold
    gather_blocks.all_gather_flat, gather_blocks.dist.isend = backend, isend
    try:
        yield counts
    finally:
        gather_blocks.P2P_MIN_BYTES, gather_blocks.all_gather_flat, gather_blocks.dist.isend = saved


def _gather_worker(threshold: int, shm: bool = False) -> dict:
    shm_exchange.set_shm_exchange(shm)
    try:
        with _patched(threshold) as counts:
            checked = _gather_checks()
    finally:
        shm_exchange._reset()
    return {"checked": checked, "backend_calls": counts["backend"], "sends": counts["isend"]}


def _gather_checks() -> int:
    import shardkit.distributed.gather_blocks as gather_blocks

    rank, world = dist.get_rank(), dist.get_world_size()
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
    return checked


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_transfers_give_the_backends_all_gather(world):
    for rank_result in run_world(_gather_worker, world, 0):
        assert rank_result["checked"] == 18
        # world 1: the backend's own (trivial) gather; otherwise every gather went point to point
        assert rank_result["backend_calls"] == (36 if world == 1 else 0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_gives_the_backends_all_gather(world):
    for rank_result in run_world(_gather_worker, world, 0, True):
        assert rank_result["checked"] == 18
        assert rank_result["backend_calls"] == 0 and rank_result["sends"] == 0  # all through shared memory


def _disagreeing_gather() -> str:
    import shardkit.distributed.gather_blocks as gather_blocks

    rank, world = dist.get_rank(), dist.get_world_size()
    n = 3 + rank  # rank 1 sends a larger block than rank 0 expects
    shm_exchange.set_shm_exchange(True)
    try:
        gather_blocks.all_gather_into(torch.empty(world * n), torch.zeros(n))
    except ValueError as err:
        return str(err)
    finally:
        shm_exchange._reset()
    return "no error"


def test_ranks_disagreeing_on_the_block_size_fail_on_every_rank():
    for message in run_world(_disagreeing_gather, 2):
        assert "disagree on sizes" in message
        assert "rank 1 sends 16 bytes to rank 0, which expects 12" in message


def test_small_blocks_take_the_backends_all_gather():
    for rank_result in run_world(_gather_worker, 2, 1 << 20):
        assert rank_result["backend_calls"] == 36


def _sharded_worker() -> bool:
    from shardkit.modules import OptimType
    from tests.sharding.test_sharded_embedding_bag_collection import _check_exact

    # gloo's transfers are what this checks: with the shared-memory exchange on (SHARDKIT_SHM_EXCHANGE=1)
    # the gradients' all-gathers go through it instead (tests/distributed/test_shm_in_place.py)
    shm_exchange.set_shm_exchange(False)
    try:
        with _patched(0) as counts:  # every all-gather of the step's gradients point to point
            for optimizer in (OptimType.SGD, OptimType.ADAGRAD):
                for weighted in (False, True):
                    _check_exact(optimizer, weighted)
    finally:
        shm_exchange._reset()
    assert counts["backend"] == 0 and counts["isend"] > 0  # the backward's all-gathers took the transfers
    return True


@pytest.mark.parametrize("world_size, local_size", [(2, None), (3, None), (4, 2)])
def test_sharded_modules_match_unsharded_with_point_to_point_gathers(world_size, local_size):
    assert all(run_world(_sharded_worker, world_size, local_world_size=local_size))


def _min_bytes_worker() -> dict:
    import shardkit.distributed.gather_blocks as gather_blocks
    from shardkit.sharding.replicated_exchange import all_gather_blocks

    rank, world = dist.get_rank(), dist.get_world_size()
    shm_exchange.set_shm_exchange(False)  # the gloo routes are what this checks
    with _patched() as counts:
        out = torch.zeros(world * 4, dtype=torch.int32)
        out[rank * 4 : (rank + 1) * 4] = rank + 1
        all_gather_blocks(out, None)  # the replicas' gather: point to point whatever the size
        sends = counts["isend"]
        small = torch.empty(world * 4, dtype=torch.int32)
        # the default threshold: a 16-byte block takes the backend's all-gather
        gather_blocks.all_gather_into(small, torch.full((4,), rank + 1, dtype=torch.int32))
    shm_exchange._reset()
    gathered, small = out.tolist(), small.tolist()
    return {"gathered": gathered, "small": small, "backend_calls": counts["backend"], "sends": sends}


def test_a_caller_may_lower_the_threshold():
    for result in run_world(_min_bytes_worker, 3):
        want = [r + 1 for r in range(3) for _ in range(4)]
        assert result["gathered"] == want and result["small"] == want
        assert result["backend_calls"] == 1  # only the default-threshold 16-byte gather
        assert result["sends"] == 2  # the replicas' gather: one send to each other rank
