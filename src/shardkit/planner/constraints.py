"""ParameterConstraints: what the user tells the planner about one table."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from shardkit.sharding.cache_params import CacheParams

# Column-wise shards narrower than this waste the lookup kernel's vector width and multiply the
# per-shard overheads; a table narrower than two of them is not split by columns.
DEFAULT_MIN_PARTITION = 32


@dataclasses.dataclass
class ParameterConstraints:
    """Constraints and workload figures of one table, keyed by table name in the planner's ``constraints``.

    Attributes:
        sharding_types: allowed ``ShardingType`` values (None: whatever the sharder supports).
        compute_kernels: allowed ``EmbeddingComputeKernel`` values (None: whatever the sharder supports).
        min_partition: narrowest column-wise shard, in columns.
        pooling_factors: mean ids per bag of each feature of the table (one value per feature, or
            one value for all); default 1.0.
        batch_sizes: per-rank batch size of each feature (one value per feature, or one for all);
            default: the planner's ``batch_size``.
        ranks: for TABLE_WISE / COLUMN_WISE, the ranks allowed to hold the table's shards.
        cache_params: ``CacheParams`` of the offloading kernels (torchrec's field): carried into the
            plan's ``ParameterSharding.cache_params`` of a table planned with one of them. Its
            ``load_factor`` sizes the cache; without one, its ``stats`` (``CacheStatistics``) let the
            planner choose the load factor (docs/planner/cache_sizing.md), else 0.2. Its fields win
            over the sharder's ``fused_params`` cache keys.
    """

    sharding_types: Optional[List[str]] = None
    compute_kernels: Optional[List[str]] = None
    min_partition: int = DEFAULT_MIN_PARTITION
    pooling_factors: Optional[List[float]] = None
    batch_sizes: Optional[List[int]] = None
    ranks: Optional[List[int]] = None
    cache_params: Optional[CacheParams] = None

    def __post_init__(self) -> None:
        if self.sharding_types is not None:
            self.sharding_types = [getattr(t, "value", t) for t in self.sharding_types]
        if self.compute_kernels is not None:
            self.compute_kernels = [getattr(k, "value", k) for k in self.compute_kernels]
        if self.min_partition < 1:
            raise ValueError(f"ParameterConstraints.min_partition must be >= 1, got {self.min_partition}")
        if self.pooling_factors is not None and any(p < 0 for p in self.pooling_factors):
            raise ValueError(f"ParameterConstraints.pooling_factors must be >= 0, got {self.pooling_factors}")
        if self.batch_sizes is not None and any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"ParameterConstraints.batch_sizes must be >= 1, got {self.batch_sizes}")
        if self.cache_params is not None and not isinstance(self.cache_params, CacheParams):
            raise TypeError(
                "ParameterConstraints.cache_params must be a CacheParams, got "
                f"{type(self.cache_params).__name__}"
            )


__all__ = ["DEFAULT_MIN_PARTITION", "ParameterConstraints"]
