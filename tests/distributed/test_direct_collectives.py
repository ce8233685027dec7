"""The direct all-to-all and the group size / rank shortcuts answer what torch's functions answer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_rank, group_size
from shardkit.distributed.direct_collectives import all_to_all_single
from shardkit.testing import run_world


def _exchange(group, rank: int, world: int) -> list:
    """Rank r sends r * 10 + d, (d + 1) times, to rank d: uneven splits, async and blocking."""
    send_splits = [d + 1 for d in range(world)]
    recv_splits = [rank + 1] * world
    send = torch.cat([torch.full((d + 1,), rank * 10 + d, dtype=torch.int64) for d in range(world)])
    out = []
    for async_op in (True, False):
        direct = torch.empty(sum(recv_splits), dtype=torch.int64)
        work = all_to_all_single(direct, send, recv_splits, send_splits, group, async_op=async_op)
        if async_op:
            work.wait()
        else:
            assert work is None
        reference = torch.empty_like(direct)
        dist.all_to_all_single(reference, send, recv_splits, send_splits, group=group)
        assert torch.equal(direct, reference)
        out.append(direct.tolist())
    return out


def _worker() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    world_group = dist.group.WORLD
    out["world"] = (group_size(world_group), group_rank(world_group), group_size(None), group_rank(None))
    out["torch_world"] = (dist.get_world_size(), dist.get_rank())
    out["exchange_world"] = _exchange(world_group, rank, world)
    out["exchange_none"] = _exchange(None, rank, world)  # no group object: torch's function
    # a subgroup of the last ranks: its own size and ranks, and non-members get torch's -1
    members = list(range(1, world))
    sub = dist.new_group(members)
    out["sub"] = (group_size(sub), group_rank(sub))
    out["torch_sub"] = (dist.get_world_size(sub), dist.get_rank(sub))
    if rank in members:
        out["exchange_sub"] = _exchange(sub, members.index(rank), len(members))
    return out


def test_group_shortcuts_and_direct_all_to_all_match_torch():
    world = 3
    results = run_world(_worker, world)
    for rank, out in enumerate(results):
        assert out["world"] == (world, rank, world, rank)
        assert out["torch_world"] == (world, rank)
        assert out["sub"] == out["torch_sub"]
        assert out["sub"] == ((world - 1, rank - 1) if rank else (-1, -1))
        expected = [[s * 10 + rank] * (rank + 1) for s in range(world)]
        flat = [x for block in expected for x in block]
        assert out["exchange_world"] == [flat, flat]
        assert out["exchange_none"] == [flat, flat]
        if rank:
            sub_rank = rank - 1
            sub_flat = [s * 10 + sub_rank for s in range(world - 1) for _ in range(sub_rank + 1)]
            assert out["exchange_sub"] == [sub_flat, sub_flat]
