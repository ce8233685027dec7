"""Find the tables a set of sharders can shard, and enumerate every allowed sharding of each.

A submodule is planned by the first sharder whose ``module_type`` it is an instance of; its children
are not searched further (the sharder shards it whole). Its tables come from the module's configs
(``EmbeddingBagCollection`` / ``EmbeddingCollection``; a quantized one's tables count their stored
bytes: packed values plus each row's scale and bias). A table's options are the product of the
sharding types and compute kernels that both the sharder and the table's ``ParameterConstraints``
allow, each with its shard layout; the estimators fill in storage and time.

The offloading kernels (``fused_uvm``, ``fused_uvm_caching``, ``quant_uvm``, ``quant_uvm_caching``) are
slower than an in-memory table: on CPU they are options only where the table's constraints name them;
on CUDA whenever the sharder offers them (as torchrec). A caching kernel gets one option per load
factor to try (:func:`cache_load_factors`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from shardkit.distributed.tensor_split import split_offsets, split_sizes
from shardkit.kernels.quant_rows import data_bytes, row_bytes
from shardkit.modules import OptimType, PoolingType
from shardkit.planner.cache_sizing import candidate_load_factors
from shardkit.planner.constraints import ParameterConstraints
from shardkit.planner.errors import PlannerError
from shardkit.planner.topology import Topology
from shardkit.planner.types import CACHING_KERNELS, OFFLOAD_KERNELS, ShardingOption, TableInfo
from shardkit.quant import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from shardkit.sharding.cache_params import (
    DEFAULT_CACHE_LOAD_FACTOR,
    CacheParams,
    cache_params_from_fused_params,
)
from shardkit.sharding.sharding_plan import table_configs
from shardkit.sharding.types import EmbeddingComputeKernel, ModuleSharder, ShardingType

# optimizer state bytes (per row, per value) of each fused optimizer, fp32 state
_STATE_BYTES = {
    OptimType.SGD: (0, 0),
    OptimType.ROWWISE_ADAGRAD: (4, 0),
    OptimType.ADAGRAD: (0, 4),
    OptimType.ADAM: (0, 8),
}


# kernels that run the module's fused optimizer in backward
_FUSED_KERNELS = {
    EmbeddingComputeKernel.FUSED.value,
    EmbeddingComputeKernel.FUSED_UVM.value,
    EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
}


def shardable_modules(
    module: nn.Module, sharders: Sequence[ModuleSharder[nn.Module]], prefix: str = ""
) -> Iterator[Tuple[str, nn.Module, ModuleSharder[nn.Module]]]:
    """``(path, submodule, sharder)`` for each submodule some sharder handles, in module order."""
    for sharder in sharders:
        if isinstance(module, sharder.module_type):
            yield prefix, module, sharder
            return
    for name, child in module.named_children():
        yield from shardable_modules(child, sharders, f"{prefix}.{name}" if prefix else name)


def _quantized_sizes(module: nn.Module, config) -> Dict[str, float]:
    """A quantized table's stored sizes (``shardkit.kernels.quant_rows``): packed bytes per value, the
    4-byte scale and bias of an int row, and its fp32 output (no gradient)."""
    storage = module.table_storage(config.name)
    return dict(
        element_size=data_bytes(config.embedding_dim, storage) / config.embedding_dim,
        row_bytes=row_bytes(config.embedding_dim, storage) - data_bytes(config.embedding_dim, storage),
        output_bytes_per_value=4.0,
        fused_optimizer=False,
    )


def _per_feature(
    values: Optional[List[float]], count: int, default: float, what: str, table: str
) -> List[float]:
    if values is None:
        return [default] * count
    if len(values) == 1:
        return list(values) * count
    if len(values) != count:
        raise ValueError(f"table {table!r}: {len(values)} {what} for {count} features")
    return list(values)


def _optimizer_of(module: nn.Module, sharder: ModuleSharder[nn.Module]) -> Optional[OptimType]:
    """The ``OptimType`` the module's FUSED tables would apply: the module's own fused optimizer, an
    in-backward one on its parameters or the sharder's ``fused_params`` (the sharder decides, see
    ``shardkit.sharding.fused_optimizer_config``); None when there is none."""
    resolve = getattr(sharder, "fused_optimizer_for", None)
    if resolve is not None:
        config = resolve(getattr(module, "embedding_bag_collection", module))
        return None if config is None else config.optimizer
    try:
        fused = module.fused_optimizer
    except (AttributeError, ValueError):  # no such property / built without a fused optimizer
        return None
    return fused.config.optimizer


def cache_load_factors(table: TableInfo) -> List[float]:
    """The load factors a caching kernel's options try for ``table``: its ``CacheParams.load_factor``
    when set; else, with ``CacheParams.stats``, the smallest load factor reaching each miss rate of
    ``cache_sizing.MISS_RATE_LADDER``; else ``DEFAULT_CACHE_LOAD_FACTOR`` (0.2)."""
    params = table.cache_params
    if params is not None and params.load_factor is not None:
        return [params.load_factor]
    if params is not None and params.stats is not None:
        return candidate_load_factors(params.stats, table.rows)
    return [DEFAULT_CACHE_LOAD_FACTOR]


def _offload_options(table: TableInfo, kernel: str) -> List[Optional[CacheParams]]:
    """The ``cache_params`` of each option of ``kernel``: None for an in-memory kernel, the table's for
    ``fused_uvm`` / ``quant_uvm``, one per load factor for a caching kernel."""
    if kernel not in OFFLOAD_KERNELS:
        return [None]
    params = table.cache_params or CacheParams()
    if kernel not in CACHING_KERNELS:
        return [table.cache_params]
    return [dataclasses.replace(params, load_factor=lf) for lf in cache_load_factors(table)]


def _named(c: ParameterConstraints, sharding_type: str, kernel: str) -> bool:
    """Whether the constraints ask for ``sharding_type`` or ``kernel`` by name (an explicit choice)."""
    return (c.sharding_types is not None and sharding_type in c.sharding_types) or (
        c.compute_kernels is not None and kernel in c.compute_kernels
    )


class EmbeddingEnumerator:
    """Lists the tables and their candidate ``ShardingOption`` s.

    Args:
        topology: the ranks to plan for.
        batch_size: per-rank batch size of every feature without a constraint saying otherwise.
        constraints: table name -> ``ParameterConstraints``.
        optimizer: the fused optimizer whose state the tables carry (default: the module's own, if it
            was built with one; else no state).

    A module built without a fused optimizer gets no FUSED* kernel options (its sharded version
    could not apply one); its tables are planned with the other kernels the sharder offers. A module
    with one (its own, an in-backward one or the sharder's ``fused_params``) gets no DENSE options
    (so no DATA_PARALLEL ones) unless its constraints name that kernel or sharding type: a DENSE
    table is trained by the model's dense optimizer, which would silently replace the one asked for.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int = 512,
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
        optimizer: Optional[OptimType] = None,
    ) -> None:
        self.topology = topology
        self.batch_size = batch_size
        self.constraints = constraints or {}
        self.optimizer = optimizer

    def tables(
        self, module: nn.Module, sharders: Sequence[ModuleSharder[nn.Module]]
    ) -> List[Tuple[TableInfo, ModuleSharder[nn.Module]]]:
        """Every table of every shardable submodule, with its sharder."""
        found = []
        for path, sub, sharder in shardable_modules(module, sharders):
            own_optim = _optimizer_of(sub, sharder)
            optim = self.optimizer or own_optim
            state_row, state_value = _STATE_BYTES[optim] if optim is not None else (0, 0)
            # a weighted collection's ids travel with an fp32 weight each
            weighted = bool(getattr(sub, "is_weighted", lambda: False)())
            quantized = isinstance(sub, (QuantEmbeddingBagCollection, QuantEmbeddingCollection))
            if quantized:  # inference tables: no optimizer state
                state_row = state_value = 0
            for position, config in enumerate(table_configs(sub)):
                c = self.constraints.get(config.name, ParameterConstraints())
                bad = [r for r in c.ranks or () if not 0 <= r < self.topology.world_size]
                if bad:
                    raise ValueError(
                        f"table {config.name!r}: constraint ranks {bad} are outside a world of "
                        f"{self.topology.world_size} ranks"
                    )
                features = max(1, config.num_features())
                pooling = _per_feature(c.pooling_factors, features, 1.0, "pooling factors", config.name)
                batches = _per_feature(c.batch_sizes, features, self.batch_size, "batch sizes", config.name)
                table = TableInfo(
                    module_path=path,
                    name=config.name,
                    rows=config.num_embeddings,
                    cols=config.embedding_dim,
                    element_size=config.dtype.itemsize,
                    pooled=config.pooling is not PoolingType.NONE,
                    bags=float(sum(batches)),
                    ids=float(sum(b * p for b, p in zip(batches, pooling))),
                    state_bytes_per_row=state_row,
                    state_bytes_per_value=state_value,
                    allowed_ranks=None if c.ranks is None else tuple(c.ranks),
                    bytes_per_id=12 if weighted else 8,
                    fused_optimizer=own_optim is not None,
                    position=position,
                )
                if quantized:
                    table = dataclasses.replace(table, **_quantized_sizes(sub, config))
                try:
                    table.cache_params = cache_params_from_fused_params(
                        getattr(sharder, "fused_params", None), c.cache_params
                    )
                except (TypeError, ValueError) as err:
                    raise type(err)(f"table {config.name!r}: {err}") from None
                found.append((table, sharder))
        return found

    def enumerate(self, table: TableInfo, sharder: ModuleSharder[nn.Module]) -> List[ShardingOption]:
        """The options of one table; ``PlannerError`` naming the table when none is allowed."""
        device = self.topology.compute_device
        c = self.constraints.get(table.name, ParameterConstraints())
        options = []
        for sharding_type in sharder.sharding_types(device):
            if c.sharding_types is not None and sharding_type not in c.sharding_types:
                continue
            if sharding_type == ShardingType.GRID_SHARD.value and c.sharding_types is None:
                continue  # as torchrec: proposed only where the constraints name it
            layout = self._layout(table, sharding_type, c.min_partition)
            if layout is None:
                continue
            for kernel in sharder.compute_kernels(sharding_type, device):
                if c.compute_kernels is not None and kernel not in c.compute_kernels:
                    continue
                if device == "cpu" and kernel in OFFLOAD_KERNELS and c.compute_kernels is None:
                    continue  # slower than in memory: on CPU only where the constraints ask for it
                if kernel in _FUSED_KERNELS and not table.fused_optimizer:
                    continue
                if (
                    table.fused_optimizer
                    and kernel == EmbeddingComputeKernel.DENSE.value
                    and not _named(c, sharding_type, kernel)
                ):
                    # a DENSE (and so a data-parallel) table is trained by the model's dense
                    # optimizer, not by the fused one its module asked for: never chosen silently
                    continue
                for cache_params in _offload_options(table, kernel):
                    options.append(
                        ShardingOption(table, sharding_type, kernel, *layout, cache_params=cache_params)
                    )
        if not options:
            offered = sharder.compute_kernels(ShardingType.TABLE_WISE.value, device)
            raise PlannerError(
                f"table {table.fqn!r} has no sharding option: the sharder allows "
                f"{sharder.sharding_types(device)} on {device}, the constraints allow sharding types "
                f"{c.sharding_types} and kernels {c.compute_kernels} (TABLE_ROW_WISE / TABLE_COLUMN_WISE / "
                f"GRID_SHARD need more than one node; COLUMN_WISE needs at least 2 x min_partition="
                f"{c.min_partition} columns, GRID_SHARD one min_partition per node; FUSED kernels need a "
                "module built with a fused_optimizer; one with a fused optimizer gets DENSE / DATA_PARALLEL "
                "options only where the constraints name that kernel or sharding type; the offloading "
                "kernels fused_uvm* / quant_uvm* need a sharder that offers them (this one offers "
                f"{offered} for table_wise) and on cpu constraints that name them)"
            )
        return options

    def _layout(
        self, table: TableInfo, sharding_type: str, min_partition: int
    ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(sizes, offsets, ranks)`` of ``sharding_type``'s shards, or None when it does not apply."""
        world, local = self.topology.world_size, self.topology.local_world_size
        multi_node = self.topology.num_nodes > 1
        st = ShardingType(sharding_type)
        if st is ShardingType.DATA_PARALLEL:
            return _rows(table, [table.rows] * world, offsets=[0] * world, ranks=range(world))
        if st is ShardingType.TABLE_WISE:
            return _rows(table, [table.rows], ranks=[-1])
        if st is ShardingType.ROW_WISE:
            return _rows(table, split_sizes(table.rows, world), ranks=range(world))
        if st is ShardingType.TABLE_ROW_WISE:
            return _rows(table, split_sizes(table.rows, local), ranks=range(local)) if multi_node else None
        if st is ShardingType.GRID_SHARD:
            return _grid(table, self.topology.num_nodes, local, min_partition) if multi_node else None
        # column-wise: as many shards of at least min_partition columns as there are ranks to hold them
        slots = local if st is ShardingType.TABLE_COLUMN_WISE else world
        count = min(slots, table.cols // min_partition)
        if count < 2 or (st is ShardingType.TABLE_COLUMN_WISE and not multi_node):
            return None
        widths = split_sizes(table.cols, count)
        sizes = torch.tensor([[table.rows, w] for w in widths], dtype=torch.int64)
        offsets = torch.tensor([[0, o] for o in split_offsets(widths)], dtype=torch.int64)
        local_ranks = list(range(count)) if st is ShardingType.TABLE_COLUMN_WISE else [-1] * count
        return sizes, offsets, torch.tensor(local_ranks, dtype=torch.int64)


def _grid(
    table: TableInfo, nodes: int, local: int, min_partition: int
) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One column block per node (block j on node j), its rows over the node's ranks; None when the
    table has fewer than ``nodes x min_partition`` columns."""
    if table.cols // min_partition < nodes:
        return None
    widths, heights = split_sizes(table.cols, nodes), split_sizes(table.rows, local)
    sizes = [[h, w] for w in widths for h in heights]
    offsets = [[r, c] for c in split_offsets(widths) for r in split_offsets(heights)]
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return as_tensor(sizes), as_tensor(offsets), as_tensor(list(range(nodes * local)))


def _rows(
    table: TableInfo, row_sizes, offsets=None, ranks=()
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    offsets = split_offsets(row_sizes) if offsets is None else offsets
    sizes = torch.tensor([[r, table.cols] for r in row_sizes], dtype=torch.int64)
    offs = torch.tensor([[o, 0] for o in offsets], dtype=torch.int64)
    return sizes, offs, torch.tensor(list(ranks), dtype=torch.int64)


__all__ = ["EmbeddingEnumerator", "cache_load_factors", "shardable_modules"]
