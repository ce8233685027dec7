from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.testing import run_world


def test_from_local_has_no_process_group():
    env = ShardingEnv.from_local(4, 3)
    assert (env.world_size, env.rank, env.process_group) == (4, 3, None)
    assert "world_size=4, rank=3, pg=local" in repr(env)


def test_integer_like_sizes_become_ints():
    env = ShardingEnv(torch.tensor(2), torch.tensor(1))
    assert (env.world_size, env.rank) == (2, 1)
    assert type(env.world_size) is int and type(env.rank) is int


@pytest.mark.parametrize(
    "world_size, rank, error, match",
    [
        (4, 4, ValueError, "rank 4 is out of range for world_size 4"),
        (4, -1, ValueError, "rank -1 is out of range for world_size 4"),
        (0, 0, ValueError, "world_size must be >= 1, got 0"),
        (2.0, 0, TypeError, "world_size must be an int, got float 2.0"),
        (2, True, TypeError, "rank must be an int, got bool True"),
    ],
)
def test_invalid_world_is_rejected(world_size, rank, error, match):
    with pytest.raises(error, match=match):
        ShardingEnv.from_local(world_size, rank)
    with pytest.raises(error, match=match):
        ShardingEnv(world_size, rank)


def test_from_process_group_needs_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialized"):
        ShardingEnv.from_process_group(None)


def _envs():
    world = ShardingEnv.from_process_group(dist.group.WORLD)
    default = ShardingEnv.from_process_group(None)
    out = {
        "world": (world.world_size, world.rank, world.process_group is dist.group.WORLD),
        "default": (default.world_size, default.rank, default.process_group is dist.group.WORLD),
    }
    if dist.get_world_size() >= 3:
        # a subgroup: members get their rank within it, others are told they are not members
        members = [1, dist.get_world_size() - 1]
        sub = dist.new_group(members)
        if dist.get_rank() in members:
            env = ShardingEnv.from_process_group(sub)
            out["sub"] = (env.world_size, env.rank, env.process_group is sub)
        else:
            with pytest.raises(ValueError, match=f"global rank {dist.get_rank()} is not a member"):
                ShardingEnv.from_process_group(sub)
            out["sub"] = "not a member"
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_from_process_group(world_size):
    results = run_world(_envs, world_size)
    for rank, out in enumerate(results):
        assert out["world"] == (world_size, rank, True)
        assert out["default"] == (world_size, rank, True)
        if world_size >= 3:
            members = [1, world_size - 1]
            expected = (2, members.index(rank), True) if rank in members else "not a member"
            assert out["sub"] == expected
