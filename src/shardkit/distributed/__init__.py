"""Layer 0: process groups and grids, collectives, awaitables and differentiable region mappings.

Everything else in shardkit communicates through this package. Each concept lives in its own module;
the most used names are re-exported here.
"""

import importlib

# imported for its effect: an exit handler that frees groups kept alive by reference cycles
import shardkit.distributed.clean_exit  # noqa: F401
from shardkit.distributed.agreement import assert_same_on_all_ranks, gather_shapes
from shardkit.distributed.awaitable import (
    Awaitable,
    GetItemLazyAwaitable,
    LazyAwaitable,
    LazyGetItemMixin,
    LazyNoWait,
    NoWait,
)
from shardkit.distributed.codecs import (
    CommType,
    QCommsConfig,
    QuantizedCommCodec,
    QuantizedCommCodecs,
    get_qcomm_codecs,
)
from shardkit.distributed.collective_utils import (
    RemoteInvocationError,
    all_reduce_sum_scalar,
    invoke_on_rank_and_broadcast_result,
    is_leader,
    run_on_leader,
)
from shardkit.distributed.comm_ops import (
    All2AllPooledInfo,
    All2AllSequenceInfo,
    All2AllVInfo,
    AllGatherBaseInfo,
    ReduceScatterBaseInfo,
    ReduceScatterInfo,
    ReduceScatterVInfo,
    VariableBatchAll2AllPooledInfo,
    all_gather_base_pooled,
    alltoall_pooled,
    alltoall_sequence,
    alltoallv,
    get_gradient_division,
    reduce_scatter_base_pooled,
    reduce_scatter_pooled,
    reduce_scatter_v_per_feature_pooled,
    reduce_scatter_v_pooled,
    set_gradient_division,
    variable_batch_alltoall_pooled,
)
from shardkit.distributed.grid import ParallelGrid, grid_layout
from shardkit.distributed.regions import (
    CopyToRegion,
    GatherFromRegion,
    GatherFromRegionLocalGrad,
    GatherFromRegionSumGrad,
    ReduceFromRegion,
    ReduceScatterToRegion,
    ScatterToRegion,
    copy_to_region,
    gather_from_region,
    gather_from_region_local_grad,
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
    "All2AllPooledInfo",
    "All2AllSequenceInfo",
    "All2AllVInfo",
    "AllGatherBaseInfo",
    "Awaitable",
    "CommType",
    "CopyToRegion",
    "GatherFromRegion",
    "GatherFromRegionLocalGrad",
    "GatherFromRegionSumGrad",
    "GetItemLazyAwaitable",
    "LazyAwaitable",
    "LazyGetItemMixin",
    "LazyNoWait",
    "NoWait",
    "ParallelGrid",
    "QCommsConfig",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "ReduceFromRegion",
    "ReduceScatterBaseInfo",
    "ReduceScatterInfo",
    "ReduceScatterToRegion",
    "ReduceScatterVInfo",
    "RemoteInvocationError",
    "ScatterToRegion",
    "ShardingEnv",
    "VariableBatchAll2AllPooledInfo",
    "all_gather_base_pooled",
    "all_reduce_sum_scalar",
    "alltoall_pooled",
    "alltoall_sequence",
    "alltoallv",
    "assert_same_on_all_ranks",
    "copy_to_region",
    "divide_and_check_no_remainder",
    "ensure_div",
    "gather_from_region",
    "gather_from_region_local_grad",
    "gather_from_region_sum_grad",
    "gather_shapes",
    "get_gradient_division",
    "get_group_rank",
    "get_local_rank",
    "get_local_size",
    "get_num_groups",
    "get_qcomm_codecs",
    "grid_layout",
    "intra_and_cross_node_pg",
    "invoke_on_rank_and_broadcast_result",
    "is_leader",
    "pad_tensor",
    "reduce_from_region",
    "reduce_scatter_base_pooled",
    "reduce_scatter_pooled",
    "reduce_scatter_to_region",
    "reduce_scatter_v_per_feature_pooled",
    "reduce_scatter_v_pooled",
    "run_on_leader",
    "scatter_to_region",
    "set_gradient_division",
    "set_validation",
    "split_sizes",
    "split_tensor",
    "trim_tensor",
    "validation_enabled",
    "variable_batch_alltoall_pooled",
]

# torchrec.distributed's names that live in the layers above (``from torchrec.distributed import
# DistributedModelParallel``): read from the torchrec-path modules beside this one on first use, so that
# importing this package never imports a higher layer (docs/names.md, "torchrec's module tree").
_TORCHREC_NAMES = {
    "DistributedModelParallel": "shardkit.distributed.model_parallel",
    "EmbeddingBagCollectionSharder": "shardkit.distributed.embeddingbag",
    "ComputeKernel": "shardkit.distributed.types",
    "EmbeddingModuleShardingPlan": "shardkit.distributed.types",
    "ModuleSharder": "shardkit.distributed.types",
    "ModuleShardingPlan": "shardkit.distributed.types",
    "ParameterSharding": "shardkit.distributed.types",
    "ShardedModule": "shardkit.distributed.types",
    "ShardingPlan": "shardkit.distributed.types",
    "ShardingPlanner": "shardkit.distributed.types",
    "ShardingType": "shardkit.distributed.types",
    "TrainPipeline": "shardkit.distributed.train_pipeline",
    "TrainPipelineBase": "shardkit.distributed.train_pipeline",
    "TrainPipelineSparseDist": "shardkit.distributed.train_pipeline",
    "get_unsharded_module_names": "shardkit.distributed.utils",
}


def __getattr__(name: str):
    if name in _TORCHREC_NAMES:
        return getattr(importlib.import_module(_TORCHREC_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
