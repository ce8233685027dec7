"""Where each piece of a sharded table's state lives: the table itself and its optimizer state.

A ``ShardLayout`` is the checkpoint-side view of a ``ParameterSharding``: the global shape of one
state tensor and the shards that tile it, each with its offsets, sizes and rank. It is pure metadata
(no communication, no tensors), built from the plan, so every rank derives the same layout.

- :func:`table_layout`: the table ``[rows, dim]`` (and any per-element optimizer state of the same
  shape, e.g. Adagrad's ``sum`` or Adam's ``exp_avg`` / ``exp_avg_sq``): the plan's shards as they are;
  for DATA_PARALLEL one full copy per rank (``replicated``).
- :func:`row_state_layout`: per-row optimizer state (row-wise Adagrad's ``sum``). For tables split by
  rows it is ``[rows]``, cut where the table's rows are cut. A table split into column blocks keeps
  one accumulator per row *and block* (each block is updated as its own table), so the global state is
  ``[rows, num_blocks]`` with block ``j`` (by column offset) in column ``j``; each rank's local tensor of
  a block is that column as ``[rows]`` (``per_block``). A grid table's blocks are cut into row blocks
  too: its shard of rows ``[r0, r1)`` of block ``j`` is rows ``[r0, r1)`` of column ``j``.
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

import torch

from shardkit.sharding.sharding_spec import ShardMetadata
from shardkit.sharding.types import ParameterSharding, ShardingType


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """The shards of one state tensor of one table.

    Attributes:
        name: the table's name (used in error messages).
        global_shape: shape of the unsharded state tensor.
        shards: every shard, in plan order; a rank's local tensors are its shards in this order.
        replicated: every rank holds the whole tensor (one shard per rank, each covering it all).
        per_block: the local tensor of a shard of sizes ``[rows, 1]`` is passed as ``[rows]``
            (per-row state of a column-split table, see :func:`row_state_layout`).
    """

    name: str
    global_shape: Tuple[int, ...]
    shards: Tuple[ShardMetadata, ...]
    replicated: bool = False
    per_block: bool = False

    @property
    def holding_ranks(self) -> List[int]:
        """The ranks that hold at least one shard, ascending."""
        return sorted({s.rank for s in self.shards})

    def local_metadata(self, rank: int) -> List[ShardMetadata]:
        """The shards placed on ``rank``, in plan order (empty when the rank holds none)."""
        return [s for s in self.shards if s.rank == rank]

    def local_shape(self, shard: ShardMetadata) -> Tuple[int, ...]:
        """Shape of the local tensor holding ``shard`` (its sizes, without the block column if per_block)."""
        sizes = tuple(int(s) for s in shard.shard_sizes)
        return sizes[:-1] if self.per_block else sizes

    def check_local(self, tensors: Sequence[torch.Tensor], rank: int) -> None:
        """Raise ``ValueError`` naming the table unless ``tensors`` are ``rank``'s shards, in order.

        Checks the number of tensors, each one's shape, and that they share one dtype.
        """
        expected = [self.local_shape(s) for s in self.local_metadata(rank)]
        if len(tensors) != len(expected):
            raise ValueError(
                f"table {self.name!r}: rank {rank} holds {len(expected)} shard(s) of shapes {expected}, "
                f"got {len(tensors)} local tensor(s)"
            )
        for i, (tensor, shape) in enumerate(zip(tensors, expected)):
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"table {self.name!r}: local shard {i} on rank {rank} should have shape {list(shape)}, "
                    f"got {list(tensor.shape)}"
                )
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise ValueError(
                f"table {self.name!r}: local shards on rank {rank} mix dtypes {sorted(map(str, dtypes))}"
            )


def table_layout(
    name: str, sharding: ParameterSharding, shape: Sequence[int], world_size: int
) -> ShardLayout:
    """The layout of table ``name`` of ``shape`` ``[rows, dim]`` (and of per-element optimizer state).

    Validates the sharding first (``ParameterSharding.check``: ``ValueError`` naming the table).
    DATA_PARALLEL gives one whole-table shard per rank of ``world_size``.
    """
    shape = tuple(int(s) for s in shape)
    sharding.check(name, shape, world_size)
    if sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
        # a DP plan has no placements; these name the ranks only (the value is a DTensor on the
        # local tensor's own device, see sharded_state.to_state_value)
        whole = tuple(
            ShardMetadata([0] * len(shape), list(shape), f"rank:{r}/cpu") for r in range(world_size)
        )
        return ShardLayout(name, shape, whole, replicated=True)
    return ShardLayout(name, shape, tuple(sharding.sharding_spec.shards))


def row_state_layout(
    name: str, sharding: ParameterSharding, shape: Sequence[int], world_size: int
) -> ShardLayout:
    """The layout of a per-row optimizer state of table ``name`` of ``shape`` ``[rows, dim]``.

    Row splits (TABLE_WISE, ROW_WISE, TABLE_ROW_WISE, DATA_PARALLEL): global ``[rows]``, shard ``i``
    covers the rows of table shard ``i``. Column splits (COLUMN_WISE, TABLE_COLUMN_WISE, and
    GRID_SHARD, whose column blocks are cut into rows): global ``[rows, num_blocks]``, local tensors
    ``[rows of the shard]`` (see the module docstring). Raises ``ValueError`` for a spec whose column
    ranges overlap without being equal (no plan constructor makes one).
    """
    table = table_layout(name, sharding, shape, world_size)
    rows, cols = table.global_shape
    if all(s.shard_offsets[1] == 0 and s.shard_sizes[1] == cols for s in table.shards):
        shards = tuple(
            ShardMetadata([s.shard_offsets[0]], [s.shard_sizes[0]], s.placement) for s in table.shards
        )
        return ShardLayout(name, (rows,), shards, replicated=table.replicated)
    spans = sorted({(s.shard_offsets[1], s.shard_offsets[1] + s.shard_sizes[1]) for s in table.shards})
    if all(b0 >= a1 for (_, a1), (b0, _) in zip(spans, spans[1:])):
        # column blocks (each cut into row blocks for GRID_SHARD): column j of the state is block j
        block = {c0: j for j, (c0, _) in enumerate(spans)}
        shards = tuple(
            ShardMetadata([s.shard_offsets[0], block[s.shard_offsets[1]]], [s.shard_sizes[0], 1], s.placement)
            for s in table.shards
        )
        return ShardLayout(name, (rows, len(spans)), shards, per_block=True)
    raise ValueError(
        f"table {name!r}: per-row state needs shards that split rows, or columns into blocks (each "
        f"possibly cut into rows); got shards {[(s.shard_offsets, s.shard_sizes) for s in table.shards]}"
    )


__all__ = ["ShardLayout", "row_state_layout", "table_layout"]
