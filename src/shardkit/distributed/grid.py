"""A data-parallel x model-parallel grid of ranks.

Ranks form ``arange(world_size).reshape(dp_size, mp_size)``. A row is a model-parallel group (``mp_size``
consecutive ranks, e.g. graph-parallel or tensor-parallel); a column is a data-parallel group (ranks
that hold the same model shard and see different data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from shardkit.distributed.agreement import assert_same_on_all_ranks
from shardkit.distributed.timeouts import new_group


def grid_layout(world_size: int, mp_size: int) -> list[list[int]]:
    """The rank table ``arange(world_size).reshape(dp, mp)`` as nested lists; validates the sizes."""
    if world_size < 1 or mp_size < 1:
        raise ValueError(f"world size and model-parallel size must be >= 1, got {world_size} and {mp_size}")
    if world_size % mp_size != 0:
        raise ValueError(f"model-parallel size {mp_size} does not divide the world size {world_size}")
    return [list(range(r * mp_size, (r + 1) * mp_size)) for r in range(world_size // mp_size)]


@dataclass
class ParallelGrid:
    """This rank's place in a dp x mp grid and the process groups of its row and column.

    Attributes:
        mp_group / dp_group: process groups of this rank's row / column.
        mp_ranks / dp_ranks: global ranks of this rank's row / column.
        mp_rank / dp_rank: this rank's index within its row / column.
    """

    world_size: int
    mp_size: int
    mp_group: Optional[dist.ProcessGroup]
    dp_group: Optional[dist.ProcessGroup]
    mp_ranks: list[int]
    dp_ranks: list[int]
    mp_rank: int
    dp_rank: int

    @property
    def dp_size(self) -> int:
        return self.world_size // self.mp_size

    @classmethod
    def create(cls, mp_size: int, backend: Optional[str] = None) -> ParallelGrid:
        """Create the row and column groups on the default process group (collective: every rank calls).
        They take the default group's timeout (``shardkit.distributed.timeouts.new_group``).

        Raises ``ValueError`` on every rank if ``mp_size`` does not divide the world size or if ranks
        pass different sizes.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelGrid.create needs torch.distributed to be initialized")
        world_size, rank = dist.get_world_size(), dist.get_rank()
        # every rank must create the same groups in the same order, so agree before new_group
        assert_same_on_all_ranks((mp_size, backend), "grid (model-parallel size, backend)")
        layout = grid_layout(world_size, mp_size)
        mp_group = dp_group = None
        mp_ranks = dp_ranks = []
        for row in layout:
            group = new_group(row, backend=backend)
            if rank in row:
                mp_group, mp_ranks = group, row
        for col_index in range(mp_size):
            col = [row[col_index] for row in layout]
            group = new_group(col, backend=backend)
            if rank in col:
                dp_group, dp_ranks = group, col
        return cls(
            world_size=world_size,
            mp_size=mp_size,
            mp_group=mp_group,
            dp_group=dp_group,
            mp_ranks=mp_ranks,
            dp_ranks=dp_ranks,
            mp_rank=mp_ranks.index(rank),
            dp_rank=dp_ranks.index(rank),
        )
