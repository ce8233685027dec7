"""torchrec's ``torchrec.distributed.sharding_plan`` in shardkit.

Re-exports only (docs/names.md, "torchrec's module tree"): each name is defined once elsewhere in
shardkit (the import says where), and nothing inside shardkit imports from this module."""

from shardkit.sharding.default_sharders import get_default_sharders, get_module_to_default_sharders
from shardkit.sharding.sharding_plan import (
    ParameterShardingGenerator,
    apply_to_all,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    placement,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)

__all__ = [
    "ParameterShardingGenerator",
    "apply_to_all",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "get_default_sharders",
    "get_module_to_default_sharders",
    "grid_shard",
    "placement",
    "row_wise",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
]
