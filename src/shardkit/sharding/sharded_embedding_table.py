"""A table as a sharding sees it: its config, compute kernel and this rank's shard (torchrec's
``ShardedEmbeddingTable`` family in ``torchrec.distributed.embedding_types``), and a group of such tables
looked up together (``GroupedEmbeddingConfig``).

These are the descriptions a user-written ``EmbeddingSharding`` builds its lookups from
(docs/extension.md); shardkit's own shardings carry the same facts in ``ShardedTable``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata

from shardkit.modules.embedding_configs import DataType, EmbeddingTableConfig, PoolingType
from shardkit.sharding.sharding_spec import ShardMetadata
from shardkit.sharding.types import EmbeddingComputeKernel


@dataclass
class EmbeddingAttributes:
    """How a table is computed: its ``EmbeddingComputeKernel``."""

    compute_kernel: EmbeddingComputeKernel = EmbeddingComputeKernel.DENSE


@dataclass
class ShardedConfig:
    """The size of this rank's shard of a table: ``local_rows`` x ``local_cols``."""

    local_rows: int = 0
    local_cols: int = 0


@dataclass
class ShardedMetaConfig(ShardedConfig):
    """``ShardedConfig`` plus where the shard sits: ``local_metadata`` (this rank's shard: offsets,
    sizes, placement) and ``global_metadata`` (every shard and the full table's size)."""

    local_metadata: Optional[ShardMetadata] = None
    global_metadata: Optional[ShardedTensorMetadata] = None


@dataclass
class ShardedEmbeddingTable(ShardedMetaConfig, EmbeddingAttributes, EmbeddingTableConfig):
    """One table (every ``EmbeddingTableConfig`` field), its compute kernel, this rank's shard of it
    and the table's fused optimizer parameters (``fused_params``)."""

    fused_params: Optional[Dict[str, Any]] = None


@dataclass
class GroupedEmbeddingConfig:
    """Tables of one data type, pooling and compute kernel that one lookup computes together, in order.

    The per-feature methods list one entry per feature of each table, tables in order; the dims are
    the shards' ``local_cols`` (a column-wise shard's width, not the table's).
    """

    data_type: DataType
    pooling: PoolingType
    is_weighted: bool
    has_feature_processor: bool
    compute_kernel: EmbeddingComputeKernel
    embedding_tables: List[ShardedEmbeddingTable]
    fused_params: Optional[Dict[str, Any]] = None

    def feature_hash_sizes(self) -> List[int]:
        return [t.num_embeddings for t in self.embedding_tables for _ in t.feature_names]

    def num_features(self) -> int:
        return sum(t.num_features() for t in self.embedding_tables)

    def dim_sum(self) -> int:
        return sum(t.local_cols * t.num_features() for t in self.embedding_tables)

    def table_names(self) -> List[str]:
        return [t.name for t in self.embedding_tables]

    def feature_names(self) -> List[str]:
        return [f for t in self.embedding_tables for f in t.feature_names]

    def embedding_dims(self) -> List[int]:
        return [t.local_cols for t in self.embedding_tables for _ in t.feature_names]

    def embedding_names(self) -> List[str]:
        return [n for t in self.embedding_tables for n in (t.embedding_names or t.feature_names)]

    def embedding_shard_metadata(self) -> List[Optional[ShardMetadata]]:
        return [t.local_metadata for t in self.embedding_tables for _ in t.feature_names]


# fused_params that do not split groups: the cache size is averaged over a group (torchrec's rule)
_CACHE_LOAD_FACTOR = "cache_load_factor"
_NOT_GROUPING = (_CACHE_LOAD_FACTOR, "_batch_key", "use_one_tbe_per_table")
_KERNEL_TYPE = {
    EmbeddingComputeKernel.FUSED_UVM: EmbeddingComputeKernel.FUSED,
    EmbeddingComputeKernel.FUSED_UVM_CACHING: EmbeddingComputeKernel.FUSED,
    EmbeddingComputeKernel.QUANT_UVM: EmbeddingComputeKernel.QUANT,
    EmbeddingComputeKernel.QUANT_UVM_CACHING: EmbeddingComputeKernel.QUANT,
}


def _group_one_rank(tables: List[ShardedEmbeddingTable], weighted: bool) -> List[GroupedEmbeddingConfig]:
    groups: Dict[tuple, List[ShardedEmbeddingTable]] = {}
    for t in tables:
        kernel = EmbeddingComputeKernel(t.compute_kernel)
        params = tuple(sorted((k, v) for k, v in (t.fused_params or {}).items() if k not in _NOT_GROUPING))
        key = (
            DataType(t.data_type),
            PoolingType(t.pooling),
            t.has_feature_processor,
            params,
            _KERNEL_TYPE.get(kernel, kernel),
        )
        groups.setdefault(key, []).append(t)
    out = []
    for (data_type, pooling, has_fp, params, kernel), members in groups.items():
        fused = dict(params)
        cached = [
            t
            for t in members
            if _CACHE_LOAD_FACTOR in (t.fused_params or {})
            and EmbeddingComputeKernel(t.compute_kernel) is EmbeddingComputeKernel.FUSED_UVM_CACHING
        ]
        if cached:  # weighted by the tables' rows
            rows = sum(t.num_embeddings for t in cached)
            fused[_CACHE_LOAD_FACTOR] = (
                sum(t.fused_params[_CACHE_LOAD_FACTOR] * t.num_embeddings for t in cached) / rows
            )
        out.append(GroupedEmbeddingConfig(data_type, pooling, weighted, has_fp, kernel, members, fused))
    return out


def group_tables(tables_per_rank: List[List[ShardedEmbeddingTable]]) -> List[List[GroupedEmbeddingConfig]]:
    """Each rank's tables grouped by data type, pooling, feature processing, fused parameters and compute
    kernel (the UVM variants with their base kernel), groups and members in order of first appearance;
    a group's ``cache_load_factor`` is its UVM-caching tables' average weighted by rows. All tables must
    agree on ``is_weighted`` (``ValueError`` otherwise). torchrec's ``embedding_sharding.group_tables``;
    shardkit's collections group their configs with ``shardkit.modules.group_table_configs``."""
    flags = {bool(t.is_weighted) for tables in tables_per_rank for t in tables}
    if len(flags) > 1:
        names = [t.name for tables in tables_per_rank for t in tables if t.is_weighted]
        raise ValueError(f"group_tables: tables {names} are weighted and the others are not")
    weighted = flags.pop() if flags else False
    return [_group_one_rank(tables, weighted) for tables in tables_per_rank]


class EmbeddingLocation(enum.IntEnum):
    """Where a fused lookup keeps a table (fbgemm's ``EmbeddingLocation``): device memory, unified
    (managed) memory, unified memory with a device cache, or host memory. On CPU every location is
    host memory; the value only records what the plan asked for."""

    DEVICE = 0
    MANAGED = 1
    MANAGED_CACHING = 2
    HOST = 3


_LOCATION = {
    EmbeddingComputeKernel.DENSE: EmbeddingLocation.DEVICE,
    EmbeddingComputeKernel.FUSED: EmbeddingLocation.DEVICE,
    EmbeddingComputeKernel.QUANT: EmbeddingLocation.DEVICE,
    EmbeddingComputeKernel.FUSED_UVM: EmbeddingLocation.MANAGED,
    EmbeddingComputeKernel.QUANT_UVM: EmbeddingLocation.MANAGED,
    EmbeddingComputeKernel.FUSED_UVM_CACHING: EmbeddingLocation.MANAGED_CACHING,
    EmbeddingComputeKernel.QUANT_UVM_CACHING: EmbeddingLocation.MANAGED_CACHING,
}


def compute_kernel_to_embedding_location(compute_kernel: EmbeddingComputeKernel) -> EmbeddingLocation:
    """The ``EmbeddingLocation`` a compute kernel puts its table in: DENSE / FUSED / QUANT -> DEVICE,
    the UVM kernels -> MANAGED, the UVM caching kernels -> MANAGED_CACHING. Takes the enum or its
    value; ``ValueError`` naming the known kernels for anything else."""
    try:
        return _LOCATION[EmbeddingComputeKernel(compute_kernel)]
    except ValueError:
        raise ValueError(
            f"compute_kernel_to_embedding_location: unknown compute kernel {compute_kernel!r}; known: "
            f"{[k.value for k in _LOCATION]}"
        ) from None


__all__ = [
    "EmbeddingAttributes",
    "EmbeddingLocation",
    "GroupedEmbeddingConfig",
    "ShardedConfig",
    "ShardedEmbeddingTable",
    "ShardedMetaConfig",
    "compute_kernel_to_embedding_location",
    "group_tables",
]
