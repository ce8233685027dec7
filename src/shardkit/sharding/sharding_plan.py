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
    ModuleSharder,
    ParameterSharding,
    ShardingType,
)

#: ``generator(name, shape, local_size, world_size, device_type) -> ParameterSharding``
ParameterShardingGenerator = Callable[[str, Tuple[int, int], int, int, str], ParameterSharding]

# build_parameter_sharding's default for sharded tables is the fused kernel (optimizer in backward); a
# replicated table is updated by the dense optimizer with the rest of the data-parallel parameters.
# The generators below leave the kernel to construct_module_sharding_plan when none is given, which
# follows torchrec: fused for a module whose tables have an optimizer in backward, else dense.
_DEFAULT_KERNEL = EmbeddingComputeKernel.FUSED.value
_DEFAULT_DP_KERNEL = EmbeddingComputeKernel.DENSE.value


def _generator(
    generate: ParameterShardingGenerator, compute_kernel: Optional[str]
) -> ParameterShardingGenerator:
    """``generate``, marked with whether its caller chose the compute kernel."""
    generate.chose_compute_kernel = compute_kernel is not None
    return generate


Devices = Union[str, Sequence[str]]  # one device type, or one per shard


def _device_of(devices: Devices, shard: int) -> str:
    return devices if isinstance(devices, str) else devices[shard]


def placement(rank: int, device_type: str, local_size: int) -> str:
    """torch's placement string of ``rank``: ``"rank:3/cpu"``, or ``"rank:3/cuda:1"`` for 2 ranks per node."""
    if device_type == "cpu":
        return f"rank:{rank}/cpu"
    return f"rank:{rank}/{device_type}:{rank % local_size}"


def row_shards(
    shape: Sequence[int],
    row_sizes: Sequence[int],
    ranks: Sequence[int],
    device_type: Devices,
    local_size: int,
) -> List[ShardMetadata]:
    """Row blocks ``row_sizes`` (in order, covering all rows) on ``ranks``, each block all columns wide;
    ``device_type`` is one device type or one per block."""
    rows, cols = int(shape[0]), int(shape[1])
    if len(row_sizes) != len(ranks):
        raise ValueError(f"{len(row_sizes)} row sizes for {len(ranks)} ranks")
    if sum(row_sizes) != rows or any(s < 0 for s in row_sizes):
        raise ValueError(f"row sizes {list(row_sizes)} do not add up to the table's {rows} rows")
    _check_devices(device_type, len(ranks))
    return [
        ShardMetadata([offset, 0], [size, cols], placement(rank, _device_of(device_type, i), local_size))
        for i, (offset, size, rank) in enumerate(zip(split_offsets(row_sizes), row_sizes, ranks))
    ]


def _check_devices(device_type: Devices, num_shards: int) -> None:
    if not isinstance(device_type, str) and len(device_type) != num_shards:
        raise ValueError(f"{len(device_type)} device types {list(device_type)} for {num_shards} shards")


def _check_column_sizes(col_sizes: Sequence[int], cols: int) -> None:
    if sum(col_sizes) != cols or any(s <= 0 for s in col_sizes):
        raise ValueError(
            f"column sizes {list(col_sizes)} must be positive and add up to the table's {cols} columns"
        )


def column_shards(
    shape: Sequence[int],
    col_sizes: Sequence[int],
    ranks: Sequence[int],
    device_type: Devices,
    local_size: int,
) -> List[ShardMetadata]:
    """Column blocks ``col_sizes`` (in order, covering all columns, none empty) on ``ranks``;
    ``device_type`` is one device type or one per block."""
    rows, cols = int(shape[0]), int(shape[1])
    if len(col_sizes) != len(ranks):
        raise ValueError(f"{len(col_sizes)} column sizes for {len(ranks)} ranks")
    _check_column_sizes(col_sizes, cols)
    _check_devices(device_type, len(ranks))
    return [
        ShardMetadata([0, offset], [rows, size], placement(rank, _device_of(device_type, i), local_size))
        for i, (offset, size, rank) in enumerate(zip(split_offsets(col_sizes), col_sizes, ranks))
    ]


def grid_shards(
    shape: Sequence[int],
    col_sizes: Sequence[int],
    block_ranks: Sequence[Sequence[int]],
    device_type: Devices,
    local_size: int,
) -> List[ShardMetadata]:
    """Column blocks ``col_sizes`` (in order, none empty), block ``j``'s rows split evenly
    (``array_split`` rule) over ``block_ranks[j]``; shards block by block, rows in order within a block;
    ``device_type`` is one device type or one per shard."""
    rows, cols = int(shape[0]), int(shape[1])
    if len(col_sizes) != len(block_ranks):
        raise ValueError(f"{len(col_sizes)} column sizes for {len(block_ranks)} blocks of ranks")
    _check_column_sizes(col_sizes, cols)
    _check_devices(device_type, sum(len(r) for r in block_ranks))
    shards: List[ShardMetadata] = []
    for col_offset, width, ranks in zip(split_offsets(col_sizes), col_sizes, block_ranks):
        row_sizes = split_sizes(rows, len(ranks))
        for row_offset, height, rank in zip(split_offsets(row_sizes), row_sizes, ranks):
            device = _device_of(device_type, len(shards))
            shards.append(
                ShardMetadata([row_offset, col_offset], [height, width], placement(rank, device, local_size))
            )
    return shards


def build_parameter_sharding(
    sharding_type: Union[str, ShardingType],
    shape: Sequence[int],
    ranks: Sequence[int],
    *,
    sizes: Optional[Sequence[int]] = None,
    compute_kernel: Optional[str] = None,
    device_type: Devices = "cpu",
    local_size: int = 1,
    world_size: Optional[int] = None,
) -> ParameterSharding:
    """A ``ParameterSharding`` of a ``[rows, cols]`` table whose shards are placed on ``ranks``, in order.

    ``sizes`` are the shards' row counts (ROW_WISE, TABLE_ROW_WISE) or column counts (COLUMN_WISE,
    TABLE_COLUMN_WISE), one per entry of ``ranks``; None splits evenly (``array_split`` rule).
    GRID_SHARD reads ``ranks`` as column blocks of ``local_size`` ranks each (one node per block, in
    order): ``sizes`` are the blocks' column counts, and each block's rows split evenly over its ranks.
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
    elif sharding_type is ShardingType.GRID_SHARD:
        if len(ranks) % local_size:
            raise ValueError(
                f"a grid_shard sharding takes whole nodes of {local_size} ranks, got ranks {ranks}"
            )
        blocks = [ranks[i : i + local_size] for i in range(0, len(ranks), local_size)]
        sizes = split_sizes(int(shape[1]), len(blocks)) if sizes is None else list(sizes)
        shards = grid_shards(shape, sizes, blocks, device_type, local_size)
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
    """Every rank holds the whole table (gradients all-reduced: by the data-parallel wrapper for the
    DENSE kernel, in the lookup's backward before the fused optimizer steps for the FUSED one)."""

    def generate(name, shape, local_size, world_size, device_type):
        return build_parameter_sharding(
            ShardingType.DATA_PARALLEL, shape, [], compute_kernel=compute_kernel, world_size=world_size
        )

    return _generator(generate, compute_kernel)


def table_wise(
    rank: int, device: Optional[str] = None, compute_kernel: Optional[str] = None
) -> ParameterShardingGenerator:
    """The whole table on ``rank``, on ``device`` (a device type, e.g. ``"cpu"`` in a CUDA job;
    default the job's)."""

    def generate(name, shape, local_size, world_size, device_type):
        return build_parameter_sharding(
            ShardingType.TABLE_WISE,
            shape,
            [rank],
            compute_kernel=compute_kernel,
            device_type=device or device_type,
            local_size=local_size,
        )

    return _generator(generate, compute_kernel)


def row_wise(
    sizes_placement: Optional[Tuple[Sequence[int], Devices]] = None, compute_kernel: Optional[str] = None
) -> ParameterShardingGenerator:
    """Row blocks over all ranks: rank ``r`` holds block ``r``.

    ``sizes_placement`` = ``(row count per rank, device type or one device type per block)`` gives
    uneven blocks (one per rank, in rank order, possibly 0) and the device they live on (e.g.
    ``"cpu"`` in a CUDA job); None splits the rows evenly by the ``array_split`` rule on the job's
    device type.
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

    return _generator(generate, compute_kernel)


def column_wise(
    ranks: Optional[Sequence[int]] = None,
    size_per_rank: Optional[Sequence[int]] = None,
    compute_kernel: Optional[str] = None,
    device_types: Optional[Sequence[str]] = None,
    *,
    sizes: Optional[Sequence[int]] = None,
) -> ParameterShardingGenerator:
    """Column blocks, block ``i`` on ``ranks[i]`` (a rank may hold several blocks).

    torchrec's keywords: ``ranks`` alone splits the columns evenly into ``len(ranks)`` blocks;
    ``size_per_rank`` gives the blocks' widths, block ``i`` on rank ``i`` (or on ``ranks[i]`` when
    both are given: shardkit's uneven blocks on any ranks), the last block trimmed to the table's
    width as torchrec does; ``device_types`` places block ``i`` on that device type. ``sizes`` is
    the older shardkit spelling of ``size_per_rank`` (with ``ranks``). Blocks are never empty.
    """
    widths = size_per_rank if size_per_rank is not None else sizes
    if ranks is None and widths is None:
        raise ValueError("column_wise needs ranks or size_per_rank")

    def generate(name, shape, local_size, world_size, device_type):
        owners = list(ranks) if ranks is not None else list(range(len(widths)))
        devices = device_type if device_types is None else list(device_types)
        block_sizes = None
        if widths is not None:
            block_sizes, owners, devices = _column_blocks(name, int(shape[1]), list(widths), owners, devices)
        _check_column_split(name, shape, len(owners))
        return build_parameter_sharding(
            ShardingType.COLUMN_WISE,
            shape,
            owners,
            sizes=block_sizes,
            compute_kernel=compute_kernel,
            device_type=devices,
            local_size=local_size,
        )

    return _generator(generate, compute_kernel)


def _column_blocks(name: str, cols: int, widths: List[int], owners: List[int], devices: Devices):
    """``(sizes, ranks, devices)`` of blocks of ``widths`` (positive) trimmed to ``cols`` as torchrec
    trims them; a block trimmed to nothing is dropped."""
    if not isinstance(devices, str) and len(devices) != len(widths):
        raise ValueError(f"table {name!r}: {len(devices)} device types for {len(widths)} column blocks")
    if len(owners) != len(widths) or any(w <= 0 for w in widths):
        raise ValueError(f"table {name!r}: column sizes {widths} must be positive, one per rank of {owners}")
    sizes, start = [], 0
    for width in widths:
        end = min(start + width, cols)
        sizes.append(end - start)
        start = end
    if start < cols:
        raise ValueError(f"table {name!r}: column sizes {widths} do not cover its {cols} columns")
    keep = [i for i, size in enumerate(sizes) if size > 0]
    kept_devices = devices if isinstance(devices, str) else [devices[i] for i in keep]
    return [sizes[i] for i in keep], [owners[i] for i in keep], kept_devices


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

    return _generator(generate, compute_kernel)


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

    return _generator(generate, compute_kernel)


def grid_shard(
    host_indexes: Sequence[int],
    compute_kernel: Optional[str] = None,
    *,
    sizes: Optional[Sequence[int]] = None,
) -> ParameterShardingGenerator:
    """Column blocks, block ``j`` on node ``host_indexes[j]``, its rows split evenly over that node's
    ranks in local rank order (torchrec's ``grid_shard``; pooled tables only).

    The columns are cut into one block per host, evenly (``array_split`` rule), or into ``sizes``
    (one width per host: shardkit's uneven blocks). torchrec cuts blocks of its column-wise block
    width and needs exactly one per host; where its plan is valid, the blocks are the same.
    """
    hosts = [int(h) for h in host_indexes]
    if not hosts or len(set(hosts)) != len(hosts):
        raise ValueError(f"grid_shard needs distinct host indexes, got {list(host_indexes)}")

    def generate(name, shape, local_size, world_size, device_type):
        if sizes is not None and len(sizes) != len(hosts):
            raise ValueError(f"table {name!r}: {len(sizes)} column sizes {list(sizes)} for hosts {hosts}")
        _check_column_split(name, shape, len(hosts))
        return build_parameter_sharding(
            ShardingType.GRID_SHARD,
            shape,
            [r for h in hosts for r in _host_ranks(name, h, local_size, world_size)],
            sizes=sizes,
            compute_kernel=compute_kernel,
            device_type=device_type,
            local_size=local_size,
        )

    return _generator(generate, compute_kernel)


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
    sharder: Optional[ModuleSharder[nn.Module]] = None,
    local_size: Optional[int] = None,
    world_size: Optional[int] = None,
    device_type: str = "cpu",
) -> EmbeddingModuleShardingPlan:
    """The plan of ``module``'s tables from one generator per table name (tables left out stay unsharded).

    torchrec's signature. ``sharder`` (optional) must shard ``module``'s type. ``world_size`` defaults
    to torch.distributed's (1 when not initialized), ``local_size`` to the ranks per node of the
    launcher's environment (``shardkit.distributed.topology.get_local_size``). An int in
    ``sharder``'s place is read as ``local_size`` (shardkit's older positional order, then
    ``world_size``, ``device_type``). A generator given no ``compute_kernel`` gets torchrec's default:
    ``fused`` when ``module``'s tables are trained in backward (an optimizer applied in backward, or
    the module's own fused optimizer), else ``dense`` (also for a data-parallel table: its fused
    optimizer then steps on the all-reduced gradient, see ``shardkit.sharding.replicated_fused_lookup``).
    Raises ``KeyError`` for a name that is not a table of ``module`` and ``ValueError`` (naming the
    table) for a sharding that does not fit the table or the world.
    """
    if isinstance(sharder, int):  # shardkit's older positional call (module, gens, local, world, device)
        legacy_device = device_type if world_size is None else world_size
        sharder, local_size, world_size, device_type = None, sharder, local_size, legacy_device
    if sharder is not None and not isinstance(module, sharder.module_type):
        raise TypeError(
            f"{type(sharder).__name__} shards {sharder.module_type.__name__}, not {type(module).__name__}"
        )
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if local_size is None:
        local_size = get_local_size(world_size)
    if local_size < 1 or world_size % local_size != 0:
        raise ValueError(f"local_size {local_size} does not divide world_size {world_size}")
    shapes: Dict[str, Tuple[int, int]] = {
        t.name: (t.num_embeddings, t.embedding_dim) for t in table_configs(module)
    }
    default_kernel = (
        EmbeddingComputeKernel.FUSED.value
        if _trained_in_backward(module)
        else EmbeddingComputeKernel.DENSE.value
    )
    plan = EmbeddingModuleShardingPlan()
    for name, generate in per_param_sharding.items():
        if name not in shapes:
            raise KeyError(f"{name!r} is not a table of {type(module).__name__}; tables: {list(shapes)}")
        sharding = generate(name, shapes[name], local_size, world_size, device_type)
        if not getattr(generate, "chose_compute_kernel", True):
            sharding.compute_kernel = default_kernel
        sharding.check(name, shapes[name], world_size)
        plan[name] = sharding
    return plan


def _trained_in_backward(module: nn.Module) -> bool:
    """Whether the tables are trained in backward: a collection built with a fused optimizer (also
    inside a feature-processed or managed-collision module), or parameters with torchrec's marker
    (``_apply_optimizer_in_backward``)."""
    if any(getattr(m, "_fused_optimizer", None) is not None for m in module.modules()):
        return True
    return any(
        hasattr(p, "_in_backward_optimizers") or hasattr(p, "_optimizer_classes") for p in module.parameters()
    )


def apply_to_all(
    module: nn.Module,
    parameter_sharding_generator: ParameterShardingGenerator,
    sharder: Optional[ModuleSharder[nn.Module]] = None,
) -> Dict[str, ParameterShardingGenerator]:
    """``{table name: parameter_sharding_generator}`` for every table of ``module`` (torchrec's helper)."""
    if sharder is not None and not isinstance(module, sharder.module_type):
        raise TypeError(
            f"{type(sharder).__name__} shards {sharder.module_type.__name__}, not {type(module).__name__}"
        )
    return {t.name: parameter_sharding_generator for t in table_configs(module)}


__all__ = [
    "ParameterShardingGenerator",
    "apply_to_all",
    "build_parameter_sharding",
    "column_shards",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "grid_shard",
    "grid_shards",
    "placement",
    "row_shards",
    "row_wise",
    "table_column_wise",
    "table_configs",
    "table_row_wise",
    "table_wise",
]
