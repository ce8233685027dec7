"""Exchanges written into and read out of the shared-memory exchange's files in place
(``SharedMemoryExchange.exchange_parts``, ``comm_ops.in_place``): the bytes of gloo's all-to-all, one
shared chunk for every peer, gloo's path where a rank has no space, and the comm ops that use them
(placed pooled all-to-all, two-rank reduce-scatter, all-gather) bitwise the same as without shared
memory, forward and backward."""

from __future__ import annotations

import glob

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed import shm_control, shm_exchange
from shardkit.testing import run_world

FILES = "/dev/shm/shardkit-x-*"


def _parts(shared: bool, limit: int) -> dict:
    """Rank ``r`` sends rank ``d`` a chunk of ``(d + 1) * (r + 2) * 1000`` float32 values (shared: every
    peer ``(r + 2) * 1000`` of one chunk) valued ``1000 r + d``; ``limit``: rank 1 cannot reserve files
    larger than this (0: no limit)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    real = shm_control.reserve
    if limit and rank == 1:

        def reserve(fd, nbytes):
            if nbytes > limit:
                raise OSError(28, "No space left on device (test)")
            real(fd, nbytes)

        shm_control.reserve = reserve

    def numel(src: int, dst: int) -> int:
        return (src + 2) * 1000 if shared else (dst + 1) * (src + 2) * 1000

    shm_exchange.set_shm_exchange(True)
    try:
        exchange = shm_exchange.exchange_for(dist.group.WORLD)
        packed, got = [], {}

        def pack(r, buf):
            packed.append(r)
            buf.view(torch.float32).fill_(1000 * rank + (0 if shared else r))

        def unpack(s, view):
            got[s] = view.view(torch.float32).clone()

        results = []
        for _ in range(3):  # more calls than one: buffers reused
            packed.clear()
            got.clear()
            work = exchange.exchange_parts(
                [numel(rank, d) * 4 for d in range(world)],
                [numel(s, rank) * 4 for s in range(world)],
                pack,
                unpack,
                shared=shared,
            )
            work.wait()
            expected = {
                s: torch.full((numel(s, rank),), float(1000 * s + (0 if shared else rank)))
                for s in range(world)
                if s != rank
            }
            results.append(
                {
                    "same": sorted(got) == sorted(expected)
                    and all(torch.equal(got[s], expected[s]) for s in expected),
                    "packed": sorted(packed),
                }
            )
        return {"results": results, "gloo_only": exchange._gloo_only, "prefix": exchange.prefix}
    finally:
        shm_control.reserve = real
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_parts_written_and_read_in_place_arrive_as_sent(world, shared):
    got_all = run_world(_parts, world, shared, 0)
    for rank, got in enumerate(got_all):
        assert not got["gloo_only"]
        for result in got["results"]:
            assert result["same"], got
            # a shared chunk is written once, whatever the peers; otherwise once per peer
            assert result["packed"] == ([-1] if shared else [r for r in range(world) if r != rank]), got
    # this world's files are all removed (its own prefix: another test's world may run beside it)
    prefix = got_all[0]["prefix"]
    assert prefix.startswith(FILES[:-1]) and {g["prefix"] for g in got_all} == {prefix}
    assert glob.glob(prefix + "*") == []


@pytest.mark.parametrize("shared", [False, True])
def test_parts_go_through_gloo_on_every_rank_where_one_has_no_space(shared):
    for got in run_world(_parts, 3, shared, 1024):
        assert got["gloo_only"]
        assert all(result["same"] for result in got["results"]), got


def _comm_ops(enabled: bool) -> dict:
    from shardkit.distributed.comm_ops.placement import ColumnPlacement
    from shardkit.distributed.comm_ops.pooled_alltoall import alltoall_pooled_placed
    from shardkit.distributed.comm_ops.reduce_scatter import (
        all_gather_base_pooled,
        reduce_scatter_base_pooled,
        reduce_scatter_v_pooled,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    shm_exchange.set_shm_exchange(enabled)
    try:
        gen = torch.Generator().manual_seed(7)
        batch = [3 + 2 * r for r in range(world)]  # uneven batches
        # 3 blocks of 4 columns per rank, interleaved and partly reversed: runs of several strides
        dest = [[b * world + r for b in range(3)][:: 1 if r % 2 else -1] for r in range(world)]
        placement = ColumnPlacement(4, dest)
        results = {}

        def run(name, fn, x):
            x = x.detach().requires_grad_(True)
            out = fn(x).wait()
            grad = torch.randn(out.shape, generator=gen)
            out.backward(grad)
            results[name] = (out.detach().clone(), x.grad.clone())

        inputs = [torch.randn(sum(batch), 12, generator=gen) for _ in range(world)]
        run("placed", lambda x: alltoall_pooled_placed(x, batch, placement, group=group), inputs[rank])
        rows = [torch.randn(world * 300, 50, generator=gen) for _ in range(world)]
        run("gather", lambda x: all_gather_base_pooled(x, group=group), rows[rank][:300])
        if world == 2:
            run("reduce_scatter", lambda x: reduce_scatter_base_pooled(x, group=group), rows[rank])
            big = [torch.randn(2 * 4096, 64, generator=gen) for _ in range(world)]  # past scratch.MIN_BYTES
            run("reduce_scatter_big", lambda x: reduce_scatter_base_pooled(x, group=group), big[rank])
            run(
                "reduce_scatter_v",
                lambda x: reduce_scatter_v_pooled(x, [100, 500], group=group),
                rows[rank][:600],
            )
        exchange = shm_exchange.exchange_for(group) if enabled else None
        return {"results": results, "calls": exchange._calls if exchange is not None else 0}
    finally:
        shm_exchange.set_shm_exchange(False)
        shm_exchange.close_all()


@pytest.mark.parametrize("world", [2, 3])
def test_comm_ops_through_shared_memory_in_place_are_bitwise_gloos(world):
    on, off = run_world(_comm_ops, world, True), run_world(_comm_ops, world, False)
    for a, b in zip(on, off):
        ops = 2 if world == 3 else 5
        assert a["calls"] >= 2 * ops and b["calls"] == 0  # every op's forward and backward through it
        assert sorted(a["results"]) == sorted(b["results"]) and len(a["results"]) == ops
        for name, (out, grad) in a["results"].items():
            ref_out, ref_grad = b["results"][name]
            assert torch.equal(out, ref_out), name
            assert torch.equal(grad, ref_grad), name
