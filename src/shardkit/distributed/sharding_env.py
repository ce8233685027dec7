"""ShardingEnv: the world a sharded module runs in (its size, this rank, and the group if there is one).

A sharded module needs the number of shards and which one is local; during training those come from a
process group, during single-host inference from plain numbers with no communication at all. Keeping
both behind one object lets the same sharding code serve both.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch.distributed as dist


class ShardingEnv:
    """World size, this rank, and the process group that connects the ranks (None when local).

    Attributes:
        world_size: number of ranks (shards), >= 1.
        rank: this process's rank in ``[0, world_size)``.
        process_group: the group the ranks communicate over; None for a local (single-host) world.
    """

    def __init__(self, world_size: int, rank: int, pg: Optional[dist.ProcessGroup] = None) -> None:
        self.world_size, self.rank = _checked_world(world_size, rank)
        self.process_group = pg

    @classmethod
    def from_process_group(cls, pg: Optional[dist.ProcessGroup]) -> ShardingEnv:
        """The environment of ``pg`` (the default group when None); typical for training.

        Raises ``RuntimeError`` when torch.distributed is not initialized and ``ValueError`` when this
        process is not a member of ``pg``.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardingEnv.from_process_group needs torch.distributed to be initialized")
        if pg is None:
            pg = dist.group.WORLD
        rank = dist.get_rank(pg)
        if rank < 0:  # torch.distributed's answer for a non-member
            raise ValueError(f"global rank {dist.get_rank()} is not a member of the process group {pg!r}")
        return cls(dist.get_world_size(pg), rank, pg)

    @classmethod
    def from_local(cls, world_size: int, rank: int) -> ShardingEnv:
        """A world of ``world_size`` shards without a process group; typical for single-host inference."""
        return cls(world_size, rank, None)

    def __repr__(self) -> str:
        where = "local" if self.process_group is None else repr(self.process_group)
        return f"ShardingEnv(world_size={self.world_size}, rank={self.rank}, pg={where})"


def _checked_world(world_size: int, rank: int) -> tuple[int, int]:
    """``(world_size, rank)`` as Python ints, validated."""
    world_size, rank = _as_int("world_size", world_size), _as_int("rank", rank)
    if world_size < 1:
        raise ValueError(f"ShardingEnv world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"ShardingEnv rank {rank} is out of range for world_size {world_size}")
    return world_size, rank


def _as_int(name: str, value: int) -> int:
    # operator.index accepts numpy / 0-dim tensor integers but not floats; a bool is surely a mistake
    if isinstance(value, bool):
        raise TypeError(f"ShardingEnv {name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"ShardingEnv {name} must be an int, got {type(value).__name__} {value!r}") from None
