"""Hand-written plans: one constructor per sharding type, and the module plan built from them.

Each constructor (``data_parallel()``, ``table_wise(rank)``, ``row_wise()``, ...) returns a
*generator*: a function of the table's name and shape and of the world (world size, ranks per node,
device type) that returns a ``ParameterSharding`` with explicit shard metadata: every shard names its
row and column offsets, its sizes and the rank that holds it, so a sharding implementation reads
exactly which rows or columns a rank owns and never re-derives a split rule.
:func:`construct_module_sharding_plan` applies the generators to a module's tables::

    plan = construct_module_sharding_plan(
        ebc, {"item": row_wise(), "country": table_wise(rank=1), "user": column_wise(ranks=[0, 1])},
        world_size=2,
    )

Uneven splits follow shardkit's ``array_split`` rule (``shardkit.distributed.tensor_split``): the first
``total % n`` shards get one more row (or column) than the rest. A row-wise shard may be empty (a table
with fewer rows than ranks); a column-wise shard may not, because an empty column block has no output.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch.distributed as dist
from torch import nn

from shardkit.distributed.tensor_split import split_offsets, split_sizes
from shardkit.distributed.topology import get_local_size
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    FeatureProcessedEmbeddingBagCollection,
)
from shardkit.modules.embedding_configs import BaseEmbeddingConfig
from shardkit.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
from shardkit.sharding.sharding_spec import EnumerableShardingSpec, ShardMetadata
from shardkit.sharding.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingType,
)

#: ``generator(name, shape, local_size, world_size, device_type) -> ParameterSharding``
ParameterShardingGenerator = Callable[[str, Tuple[int, int], int, int, str], ParameterSharding]

# Sharded tables default to the fused kernel (optimizer in backward); a replicated table is updated
# by the dense optimizer with the rest of the data-parallel parameters, so it uses the dense kernel.
_DEFAULT_KERNEL = EmbeddingComputeKernel.FUSED.value
_DEFAULT_DP_KERNEL = EmbeddingComputeKernel.DENSE.value


def placement(rank: int, device_type: str, local_size: int) -> str:
    """torch's placement string of ``rank``: ``"rank:3/cpu"``, or ``"rank:3/cuda:1"`` for 2 ranks per node."""
    if device_type == "cpu":
        return f"rank:{rank}/cpu"
    return f"rank:{rank}/{device_type}:{rank % local_size}"


def row_shards(
    shape: Sequence[int], row_sizes: Sequence[int], ranks: Sequence[int], device_type: str, local_size: int
) -> List[ShardMetadata]:
    """Row blocks ``row_sizes`` (in order, covering all rows) on ``ranks``, each block all columns wide."""
    rows, cols = int(shape[0]), int(shape[1])
    if len(row_sizes) != len(ranks):
        raise ValueError(f"{len(row_sizes)} row sizes for {len(ranks)} ranks")
    if sum(row_sizes) != rows or any(s < 0 for s in row_sizes):
        raise ValueError(f"row sizes {list(row_sizes)} do not add up to the table's {rows} rows")
    return [
        ShardMetadata([offset, 0], [size, cols], placement(rank, device_type, local_size))
        for offset, size, rank in zip(split_offsets(row_sizes), row_sizes, ranks)
    ]


def column_shards(
    shape: Sequence[int], col_sizes: Sequence[int], ranks: Sequence[int], device_type: str, local_size: int
) -> List[ShardMetadata]:
    """Column blocks ``col_sizes`` (in order, covering all columns, none empty) on ``ranks``."""
    rows, cols = int(shape[0]), int(shape[1])
    if len(col_sizes) != len(ranks):
        raise ValueError(f"{len(col_sizes)} column sizes for {len(ranks)} ranks")
    if sum(col_sizes) != cols or any(s <= 0 for s in col_sizes):
        raise ValueError(
            f"column sizes {list(col_sizes)} must be positive and add up to the table's {cols} columns"
        )
    return [
        ShardMetadata([0, offset], [rows, size], placement(rank, device_type, local_size))
        for offset, size, rank in zip(split_offsets(col_sizes), col_sizes, ranks)
    ]


def build_parameter_sharding(
    sharding_type: Union[str, ShardingType],
    shape: Sequence[int],
    ranks: Sequence[int],
    *,
    sizes: Optional[Sequence[int]] = None,
    compute_kernel: Optional[str] = None,
    device_type: str = "cpu",
    local_size: int = 1,
    world_size: Optional[int] = None,
) -> ParameterSharding:
    """A ``ParameterSharding`` of a ``[rows, cols]`` table whose shards are placed on ``ranks``, in order.

    ``sizes`` are the shards' row counts (ROW_WISE, TABLE_ROW_WISE) or column counts (COLUMN_WISE,
    TABLE_COLUMN_WISE), one per entry of ``ranks``; None splits evenly (``array_split`` rule).
    TABLE_WISE takes one rank; DATA_PARALLEL ignores ``ranks`` and ``sizes`` (every rank of
    ``world_size`` holds the whole table, and there is no spec). Used by the constructors below and
    by the planner, so hand-written and planned shardings have the same layout.
    """
    sharding_type = ShardingType(sharding_type)
    ranks = [int(r) for r in ranks]
    if sharding_type is ShardingType.DATA_PARALLEL:
        every = list(range(world_size)) if world_size is not None else ranks
        return ParameterSharding(sharding_type.value, compute_kernel or _DEFAULT_DP_KERNEL, every, None)
    if not ranks:
        raise ValueError(f"a {sharding_type.value} sharding needs at least one rank")
    if sharding_type is ShardingType.TABLE_WISE:
        if len(ranks) != 1:
            raise ValueError(f"a table_wise sharding names one rank, got {ranks}")
        shards = row_shards(shape, [int(shape[0])], ranks, device_type, local_size)
    elif sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        sizes = split_sizes(int(shape[0]), len(ranks)) if sizes is None else list(sizes)
        shards = row_shards(shape, sizes, ranks, device_type, local_size)
    else:
        sizes = split_sizes(int(shape[1]), len(ranks)) if sizes is None else list(sizes)
        shards = column_shards(shape, sizes, ranks, device_type, local_size)
    return ParameterSharding(
        sharding_type.value,
        compute_kernel or _DEFAULT_KERNEL,
        [s.rank for s in shards],
        EnumerableShardingSpec(shards),
    )


def data_parallel(compute_kernel: Optional[str] = None) -> ParameterShardingGenerator:
    """Every rank holds the whole table (gradients all-reduced like any dense parameter)."""

    def generate(name, shape, local_size, world_size, device_type):
        return build_parameter_sharding(
            ShardingType.DATA_PARALLEL, shape, [], compute_kernel=compute_kernel, world_size=world_size
        )

    return generate


def table_wise(rank: int, compute_kernel: Optional[str] = None) -> ParameterShardingGenerator:
    """The whole table on ``rank``."""

    def generate(name, shape, local_size, world_size, device_type):
        return build_parameter_sharding(
            ShardingType.TABLE_WISE,
            shape,
            [rank],
            compute_kernel=compute_kernel,
            device_type=device_type,
            local_size=local_size,
        )

    return generate


def row_wise(
    sizes_placement: Optional[Tuple[Sequence[int], str]] = None, compute_kernel: Optional[str] = None
) -> ParameterShardingGenerator:
    """Row blocks over all ranks: rank ``r`` holds block ``r``.

    ``sizes_placement`` = ``(row count per rank, device type)`` gives uneven blocks (one per rank, in
    rank order, possibly 0) and the device they live on (e.g. ``"cpu"`` in a CUDA job); None splits
    the rows evenly by the ``array_split`` rule on the job's device type.
    """

    def generate(name, shape, local_size, world_size, device_type):
        sizes, device = None, device_type
        if sizes_placement is not None:
            sizes, device = list(sizes_placement[0]), sizes_placement[1]
            if len(sizes) != world_size:
                raise ValueError(
                    f"table {name!r}: row_wise sizes {sizes} name {len(sizes)} ranks, "
                    f"the world has {world_size}"
                )
        return build_parameter_sharding(
            ShardingType.ROW_WISE,
            shape,
            range(world_size),
            sizes=sizes,
            compute_kernel=compute_kernel,
            device_type=device,
            local_size=local_size,
        )

    return generate


def column_wise(
    ranks: Sequence[int], sizes: Optional[Sequence[int]] = None, compute_kernel: Optional[str] = None
) -> ParameterShardingGenerator:
    """Column blocks, block ``i`` on ``ranks[i]`` (a rank may hold several blocks).

    ``sizes`` are the blocks' widths (uneven allowed, none empty); None splits the columns evenly
    into ``len(ranks)`` blocks.
    """

    def generate(name, shape, local_size, world_size, device_type):
        _check_column_split(name, shape, len(ranks))
        return build_parameter_sharding(
            ShardingType.COLUMN_WISE,
            shape,
            ranks,
            sizes=sizes,
            compute_kernel=compute_kernel,
            device_type=device_type,
            local_size=local_size,
        )

    return generate


def table_row_wise(host_index: int, compute_kernel: Optional[str] = None) -> ParameterShardingGenerator:
    """Row blocks over the ``local_size`` ranks of node ``host_index`` (even split, local rank order)."""

    def generate(name, shape, local_size, world_size, device_type):
        return build_parameter_sharding(
            ShardingType.TABLE_ROW_WISE,
            shape,
            _host_ranks(name, host_index, local_size, world_size),
            compute_kernel=compute_kernel,
            device_type=device_type,
            local_size=local_size,
        )

    return generate


def table_column_wise(
    host_index: int, num_shards: Optional[int] = None, compute_kernel: Optional[str] = None
) -> ParameterShardingGenerator:
    """Column blocks over the ranks of node ``host_index``: ``num_shards`` blocks (default: one per
    local rank) dealt to the node's ranks in local rank order, round robin when there are more."""

    def generate(name, shape, local_size, world_size, device_type):
        host = _host_ranks(name, host_index, local_size, world_size)
        count = num_shards or len(host)
        _check_column_split(name, shape, count)
        return build_parameter_sharding(
            ShardingType.TABLE_COLUMN_WISE,
            shape,
            [host[i % len(host)] for i in range(count)],
            compute_kernel=compute_kernel,
            device_type=device_type,
            local_size=local_size,
        )

    return generate


def _host_ranks(name: str, host_index: int, local_size: int, world_size: int) -> List[int]:
    num_hosts = world_size // local_size
    if not 0 <= host_index < num_hosts:
        raise ValueError(
            f"table {name!r}: host_index {host_index} is out of range for {num_hosts} node(s) "
            f"of {local_size} ranks"
        )
    return list(range(host_index * local_size, (host_index + 1) * local_size))


def _check_column_split(name: str, shape: Sequence[int], num_shards: int) -> None:
    if num_shards < 1 or num_shards > int(shape[1]):
        raise ValueError(
            f"table {name!r}: cannot split {int(shape[1])} columns into {num_shards} non-empty column shards"
        )


def table_configs(module: nn.Module) -> List[BaseEmbeddingConfig]:
    """The table configs of an ``EmbeddingBagCollection`` or ``EmbeddingCollection`` (also inside a
    managed-collision module or a ``FeatureProcessedEmbeddingBagCollection``), in declaration order."""
    if isinstance(module, FeatureProcessedEmbeddingBagCollection):
        module = module.embedding_bag_collection
    if isinstance(module, EmbeddingBagCollection):
        return module.embedding_bag_configs()
    if isinstance(module, EmbeddingCollection):
        return module.embedding_configs()
    if isinstance(module, BaseManagedCollisionEmbeddingCollection):
        return table_configs(module._embedding_module)  # MC tables are planned with their slot count
    raise TypeError(
        f"{type(module).__name__} has no table configs; "
        "expected an EmbeddingBagCollection or EmbeddingCollection"
    )


def construct_module_sharding_plan(
    module: nn.Module,
    per_param_sharding: Mapping[str, ParameterShardingGenerator],
    local_size: Optional[int] = None,
    world_size: Optional[int] = None,
    device_type: str = "cpu",
) -> EmbeddingModuleShardingPlan:
    """The plan of ``module``'s tables from one generator per table name (tables left out stay unsharded).

    ``world_size`` defaults to torch.distributed's (1 when not initialized), ``local_size`` to the
    ranks per node of the launcher's environment (``shardkit.distributed.topology.get_local_size``).
    Raises ``KeyError`` for a name that is not a table of ``module`` and ``ValueError`` (naming the
    table) for a sharding that does not fit the table or the world.
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if local_size is None:
        local_size = get_local_size(world_size)
    if local_size < 1 or world_size % local_size != 0:
        raise ValueError(f"local_size {local_size} does not divide world_size {world_size}")
    shapes: Dict[str, Tuple[int, int]] = {
        t.name: (t.num_embeddings, t.embedding_dim) for t in table_configs(module)
    }
    plan = EmbeddingModuleShardingPlan()
    for name, generate in per_param_sharding.items():
        if name not in shapes:
            raise KeyError(f"{name!r} is not a table of {type(module).__name__}; tables: {list(shapes)}")
        sharding = generate(name, shapes[name], local_size, world_size, device_type)
        sharding.check(name, shapes[name], world_size)
        plan[name] = sharding
    return plan


__all__ = [
    "ParameterShardingGenerator",
    "build_parameter_sharding",
    "column_shards",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "placement",
    "row_shards",
    "row_wise",
    "table_column_wise",
    "table_configs",
    "table_row_wise",
    "table_wise",
]
