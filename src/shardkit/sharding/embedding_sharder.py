"""What the embedding collections' sharders share (torchrec's ``BaseEmbeddingSharder``): the sharding
types, the compute kernels offered (the offloading ones included), the fused optimizer and the cache
options a sharder's ``fused_params`` carry."""

from __future__ import annotations

from typing import List, Optional

from torch import nn

from shardkit.modules.fused_optimizers import FusedOptimizerConfig
from shardkit.sharding.fused_optimizer_config import FusedParamsSharder, resolve_fused_optimizer
from shardkit.sharding.offload_plan import with_fused_cache_params
from shardkit.sharding.types import EmbeddingComputeKernel, EmbeddingModuleShardingPlan, M, ShardingType


class BaseEmbeddingSharder(FusedParamsSharder[M]):
    """What the embedding collections' sharders share: every sharding type; FUSED or DENSE kernels
    (a FUSED data-parallel table all-reduces its gradient rows before its fused optimizer steps, see
    ``shardkit.sharding.replicated_fused_lookup``; a DENSE one is averaged by the data-parallel wrapper),
    and the offloading FUSED_UVM / FUSED_UVM_CACHING for the other types (docs/offload.md).

    Args (torchrec's order):
        fused_params: the fused optimizer of a collection built without one and without an
            in-backward optimizer (``{"optimizer": ..., "learning_rate": ...}``; see
            ``shardkit.sharding.fused_optimizer_config``).
        qcomm_codecs_registry: as for ``ModuleSharder``.
    """

    def fused_optimizer_for(self, module: nn.Module) -> Optional[FusedOptimizerConfig]:
        """The fused optimizer ``module``'s FUSED tables apply (see ``resolve_fused_optimizer``)."""
        return resolve_fused_optimizer(module, self._fused_params)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        # grid sharding is for pooled tables (EmbeddingBagCollectionSharder adds it), as in torchrec
        return [t.value for t in ShardingType if t is not ShardingType.GRID_SHARD]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        kernels = [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE.value]
        if sharding_type != ShardingType.DATA_PARALLEL.value:  # a replica stays in memory
            kernels += [
                EmbeddingComputeKernel.FUSED_UVM.value,
                EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
            ]
        return kernels

    def plan_with_cache_params(self, params: EmbeddingModuleShardingPlan) -> EmbeddingModuleShardingPlan:
        """``params`` with the offloaded tables' cache options completed from ``fused_params``' cache keys
        (``cache_load_factor``, ``cache_algorithm``, ``prefetch_pipeline``, ``offload_dir``, ...)."""
        return with_fused_cache_params(params, self._fused_params)


__all__ = ["BaseEmbeddingSharder"]
