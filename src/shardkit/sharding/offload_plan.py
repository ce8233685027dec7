"""From a plan's offloading compute kernel and cache params to the storage a shard gets.

``fused_uvm`` and ``fused_uvm_caching`` tables are stored by :class:`~shardkit.modules.offloaded_lookup.
OffloadedEmbeddingLookup` (a backing file per shard, optionally a RAM cache of hot rows); this module
reads what the plan asks for (``ParameterSharding.cache_params``: load factor, algorithm, prefetch, the
backing directory) into an :class:`OffloadSpec`, and checks before anything is allocated that the backing
directory can hold every offloaded shard of this rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from shardkit.kernels.offload import OffloadSpec
from shardkit.kernels.offload.backing_store import (
    bytes_needed,
    check_directory,
    default_offload_dir,
    field_specs,
)
from shardkit.modules.fused_optimizers import FusedOptimizerConfig, _state_shapes
from shardkit.sharding.cache_params import cache_params_from_fused_params
from shardkit.sharding.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingType,
)

OFFLOAD_KINDS = {
    EmbeddingComputeKernel.FUSED_UVM.value: "uvm",
    EmbeddingComputeKernel.FUSED_UVM_CACHING.value: "caching",
    EmbeddingComputeKernel.QUANT_UVM.value: "uvm",
    EmbeddingComputeKernel.QUANT_UVM_CACHING.value: "caching",
}
DEFAULT_LOAD_FACTOR = 0.2  # torchrec's default cache_load_factor


def _algorithm_name(algorithm: Any) -> str:
    if algorithm is None:
        return "lru"
    name = getattr(algorithm, "name", algorithm)
    return str(name).lower()


def offload_spec(table: str, sharding: ParameterSharding, data_type: Any = None) -> Optional[OffloadSpec]:
    """The storage ``sharding`` asks for table ``table``: None for an in-memory kernel.

    Raises ValueError naming the table for a cache precision other than the table's (the cache holds
    the table's rows as they are, which is what keeps training exact).
    """
    kind = OFFLOAD_KINDS.get(sharding.compute_kernel)
    if kind is None:
        return None
    if sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
        return None  # the data-parallel sharding refuses every kernel but dense / fused, naming the table
    params = sharding.cache_params
    precision = getattr(params, "precision", None)
    if precision is not None and getattr(precision, "value", precision) != getattr(
        data_type, "value", data_type
    ):
        raise ValueError(
            f"table {table!r}: cache precision {precision} differs from the table's data type {data_type}; "
            f"shardkit caches rows as stored (exact training): leave CacheParams.precision unset"
        )
    load_factor = getattr(params, "load_factor", None)
    return OffloadSpec(
        kind=kind,
        load_factor=DEFAULT_LOAD_FACTOR if load_factor is None else float(load_factor),
        algorithm=_algorithm_name(getattr(params, "algorithm", None)),
        directory=getattr(params, "offload_dir", None),
        prefetch=bool(getattr(params, "prefetch_pipeline", None) or False),
    )


def with_fused_cache_params(
    plan: EmbeddingModuleShardingPlan, fused_params: Optional[Dict[str, Any]]
) -> EmbeddingModuleShardingPlan:
    """``plan`` with each offloaded table's ``cache_params`` completed from the sharder's ``fused_params``
    cache keys (``cache_load_factor``, ``cache_algorithm``, ...; the plan's own fields win, as torchrec's
    ``add_params_from_parameter_sharding``). The caller's plan is not modified."""
    if not fused_params:
        return plan
    out = type(plan)(plan)  # a copy of the same mapping type (EmbeddingModuleShardingPlan or dict)
    for name, sharding in plan.items():
        if sharding.compute_kernel in OFFLOAD_KINDS:
            merged = cache_params_from_fused_params(fused_params, sharding.cache_params)
            out[name] = dataclasses.replace(sharding, cache_params=merged)
    return out


def check_offload_space(shards: Dict[str, tuple], fused_optimizer: Optional[FusedOptimizerConfig]) -> None:
    """OSError naming the directory and the bytes needed if the offloaded shards of this rank do not fit.

    shards: ``name -> (OffloadSpec, rows, cols, dtype)`` of this rank's offloaded shards.
    """
    needed: Dict[str, int] = {}
    for spec, rows, cols, dtype in shards.values():
        state = {} if fused_optimizer is None else _state_shapes(fused_optimizer.optimizer, rows, cols)
        directory = spec.directory or default_offload_dir()
        needed[directory] = needed.get(directory, 0) + bytes_needed(field_specs((rows, cols), dtype, state))
    for directory, total in needed.items():
        check_directory(directory, total)


__all__ = [
    "DEFAULT_LOAD_FACTOR",
    "OFFLOAD_KINDS",
    "check_offload_space",
    "offload_spec",
    "with_fused_cache_params",
]
