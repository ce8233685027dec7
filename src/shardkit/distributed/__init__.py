"""Layer 0: process groups and grids, collectives, awaitables and differentiable region mappings.

Everything else in shardkit communicates through this package. Each concept lives in its own module;
the most used names are re-exported here.
"""

from shardkit.distributed.agreement import assert_same_on_all_ranks, gather_shapes
from shardkit.distributed.awaitable import Awaitable, LazyAwaitable, LazyNoWait, NoWait
from shardkit.distributed.collective_utils import (
    RemoteInvocationError,
    all_reduce_sum_scalar,
    invoke_on_rank_and_broadcast_result,
    is_leader,
    run_on_leader,
)
from shardkit.distributed.grid import ParallelGrid, grid_layout
from shardkit.distributed.regions import (
    CopyToRegion,
    GatherFromRegion,
    GatherFromRegionSumGrad,
    ReduceFromRegion,
    ReduceScatterToRegion,
    ScatterToRegion,
    copy_to_region,
    gather_from_region,
    gather_from_region_sum_grad,
    reduce_from_region,
    reduce_scatter_to_region,
    scatter_to_region,
)
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.distributed.tensor_split import (
    divide_and_check_no_remainder,
    ensure_div,
    pad_tensor,
    split_sizes,
    split_tensor,
    trim_tensor,
)
from shardkit.distributed.topology import (
    get_group_rank,
    get_local_rank,
    get_local_size,
    get_num_groups,
    intra_and_cross_node_pg,
)
from shardkit.distributed.validation import set_validation, validation_enabled

__all__ = [
    "Awaitable",
    "CopyToRegion",
    "GatherFromRegion",
    "GatherFromRegionSumGrad",
    "LazyAwaitable",
    "LazyNoWait",
    "NoWait",
    "ParallelGrid",
    "ReduceFromRegion",
    "ReduceScatterToRegion",
    "RemoteInvocationError",
    "ScatterToRegion",
    "ShardingEnv",
    "all_reduce_sum_scalar",
    "assert_same_on_all_ranks",
    "copy_to_region",
    "divide_and_check_no_remainder",
    "ensure_div",
    "gather_from_region",
    "gather_from_region_sum_grad",
    "gather_shapes",
    "get_group_rank",
    "get_local_rank",
    "get_local_size",
    "get_num_groups",
    "grid_layout",
    "intra_and_cross_node_pg",
    "invoke_on_rank_and_broadcast_result",
    "is_leader",
    "pad_tensor",
    "reduce_from_region",
    "reduce_scatter_to_region",
    "run_on_leader",
    "scatter_to_region",
    "set_validation",
    "split_sizes",
    "split_tensor",
    "trim_tensor",
    "validation_enabled",
]
