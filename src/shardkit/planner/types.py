"""The planner's working types: a table as the planner sees it, and one way of sharding it.

Shards are kept as tensors (one row per shard) rather than objects, because the planner handles every
option of every table (1000 tables x 64 ranks is 10^5 shards) and the estimators work on whole
options at once. They are small CPU tensors: torch is shardkit's only dependency.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from shardkit.planner.constraints import ParameterConstraints
from shardkit.planner.errors import PlannerError
from shardkit.planner.topology import Topology
from shardkit.sharding.cache_params import CacheParams
from shardkit.sharding.types import EmbeddingComputeKernel, ShardingType

# How the partitioner may move an option's shards:
FREE = "free"  # each shard to any rank (TABLE_WISE, COLUMN_WISE)
FIXED = "fixed"  # each shard on a given rank (DATA_PARALLEL, ROW_WISE, GRID_SHARD): nothing to choose
HOST = "host"  # shard i on local rank i of one node, the node to choose (TABLE_ROW_WISE / _COLUMN_WISE)

_K = EmbeddingComputeKernel
# kernels that keep the table in the slow tier (DDR on CUDA, the offload directory's disk on CPU) ...
OFFLOAD_KERNELS = frozenset(
    k.value for k in (_K.FUSED_UVM, _K.FUSED_UVM_CACHING, _K.QUANT_UVM, _K.QUANT_UVM_CACHING)
)
# ... and those of them that keep a cache of load_factor x rows rows in the fast tier
CACHING_KERNELS = frozenset(k.value for k in (_K.FUSED_UVM_CACHING, _K.QUANT_UVM_CACHING))

PLACEMENT_KIND = {
    ShardingType.TABLE_WISE.value: FREE,
    ShardingType.COLUMN_WISE.value: FREE,
    ShardingType.DATA_PARALLEL.value: FIXED,
    ShardingType.ROW_WISE.value: FIXED,
    ShardingType.TABLE_ROW_WISE.value: HOST,
    ShardingType.TABLE_COLUMN_WISE.value: HOST,
    ShardingType.GRID_SHARD.value: FIXED,  # column block j on node j
}


@dataclasses.dataclass
class TableInfo:
    """One table of one module, with the workload the cost model needs.

    Attributes:
        module_path: FQN of the module that owns the table ("" for the root).
        name: table name (the key of the module's plan).
        rows, cols: table shape; element_size: bytes per value (a quantized table: its packed bytes
            per value, 0.5 for int4).
        pooled: pooled lookups (one output row per bag) or sequence lookups (one per id).
        bags: bags per step on one rank (sum over the table's features of their batch sizes).
        ids: ids per step on one rank (sum over features of batch size x pooling factor).
        state_bytes_per_row, state_bytes_per_value: optimizer state per row and per value (row-wise
            Adagrad: 4 per row; Adagrad: 4 per value; Adam: 8 per value; SGD: none).
        allowed_ranks: ranks that may hold its shards (``ParameterConstraints.ranks``), None for all.
        bytes_per_id: bytes an id costs in the input dist: 8 (int64), 12 with a per-id fp32 weight.
        fused_optimizer: whether its module was built with a fused optimizer (the FUSED kernels
            apply it in backward, so a sharded module refuses them without one).
        row_bytes: bytes per row of a shard beside its values (a quantized row's fp16 scale and bias).
        output_bytes_per_value: bytes per output value of one step (None: the output and its gradient
            in the table dtype, ``2 * element_size``; a quantized table: its fp32 output only).
        cache_params: the table's ``CacheParams`` for the offloading kernels (its constraints' merged
            with the sharder's ``fused_params`` cache keys), None when neither gives any.
        position: the table's index among its module's tables (its features' place in the module's
            input and output order).
    """

    module_path: str
    name: str
    rows: int
    cols: int
    element_size: float
    pooled: bool
    bags: float
    ids: float
    state_bytes_per_row: int = 0
    state_bytes_per_value: int = 0
    allowed_ranks: Optional[tuple] = None
    bytes_per_id: int = 8
    fused_optimizer: bool = True
    row_bytes: int = 0
    output_bytes_per_value: Optional[float] = None
    cache_params: Optional[CacheParams] = None
    position: int = 0

    @property
    def fqn(self) -> str:
        return f"{self.module_path}.{self.name}" if self.module_path else self.name

    @property
    def nbytes(self) -> int:
        return int(self.rows * self.cols * self.element_size) + self.rows * self.row_bytes


@dataclasses.dataclass
class ShardingOption:
    """One candidate sharding of a table: its shards, their estimated storage and time, their ranks.

    Attributes:
        table: the table.
        sharding_type, compute_kernel: ``ShardingType`` / ``EmbeddingComputeKernel`` values.
        sizes, offsets: ``[k, 2]`` int64, each shard's (rows, cols) and (row offset, col offset).
        ranks: ``[k]`` int64; for FIXED options the shard's rank, for HOST options the local rank
            within the chosen node, for FREE options -1 until the partitioner places them.
        hbm, ddr: ``[k]`` float64 bytes of device / host memory per shard (set by the storage estimator).
        disk: ``[k]`` float64 bytes per shard in the CPU offload tier (the offloading kernels on CPU;
            zeros otherwise).
        compute, comm: ``[k]`` float64 seconds per training step per shard (set by the perf estimator).
        cache_params: for an offloading kernel, the ``CacheParams`` the plan carries (a caching kernel's
            with the ``load_factor`` this option sizes its cache with); None otherwise.
        hit_rate: a caching kernel's expected share of lookups served by the cache (set by the perf
            estimator; 0 for the other offloading kernels, None for in-memory ones);
            hit_rate_source: ``"statistics"`` (``CacheStatistics.expected_miss_rate``) or
            ``"cost model"`` (``CostModel.cache_hit_rate``).
    """

    table: TableInfo
    sharding_type: str
    compute_kernel: str
    sizes: torch.Tensor
    offsets: torch.Tensor
    ranks: torch.Tensor
    hbm: Optional[torch.Tensor] = None
    ddr: Optional[torch.Tensor] = None
    compute: Optional[torch.Tensor] = None
    comm: Optional[torch.Tensor] = None
    disk: Optional[torch.Tensor] = None
    cache_params: Optional[CacheParams] = None
    hit_rate: Optional[float] = None
    hit_rate_source: Optional[str] = None

    @property
    def kind(self) -> str:
        return PLACEMENT_KIND[self.sharding_type]

    @property
    def num_shards(self) -> int:
        return len(self.sizes)

    @property
    def perf(self) -> torch.Tensor:
        """``[k]`` estimated seconds per step of each shard (compute + communication)."""
        return self.compute + self.comm

    # The proposer and partitioner read these summaries many times per option: computed once, after
    # the estimators have run (an option's estimates do not change afterwards).
    @functools.cached_property
    def total_perf(self) -> float:
        return float(self.perf.sum())

    @functools.cached_property
    def max_perf(self) -> float:
        return float(self.perf.max())

    @functools.cached_property
    def max_hbm(self) -> float:
        return float(self.hbm.max())

    @functools.cached_property
    def max_ddr(self) -> float:
        return float(self.ddr.max())

    @functools.cached_property
    def max_storage(self) -> float:
        return float((self.hbm + self.ddr).max())

    def placed(self, ranks: torch.Tensor) -> ShardingOption:
        """A copy of this option with its shards on ``ranks`` (the estimates are shared, not copied)."""
        copy = dataclasses.replace(self, ranks=torch.as_tensor(ranks, dtype=torch.int64))
        copy.__dict__.update({k: v for k, v in self.__dict__.items() if k in _SUMMARIES})
        return copy


_SUMMARIES = ("total_perf", "max_perf", "max_hbm", "max_ddr", "max_storage")


# ParameterConstraints, PlannerError and Topology are defined in their own files and re-exported here:
# torchrec's ``torchrec.distributed.planner.types`` holds them (docs/names.md, "torchrec's module tree").
__all__ = [
    "CACHING_KERNELS",
    "FIXED",
    "FREE",
    "HOST",
    "OFFLOAD_KERNELS",
    "PLACEMENT_KIND",
    "ParameterConstraints",
    "PlannerError",
    "ShardingOption",
    "TableInfo",
    "Topology",
]
