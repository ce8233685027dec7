"""Sharded quantized managed-collision collections for inference (torchrec's
``ShardedQuantManagedCollisionEmbeddingCollection`` and its sharder, plus the bag variant).

The sharded MC collection (ids sent to the owners of their buckets and remapped there) in front of the
sharded quantized collection, as the training MC modules compose them
(:mod:`shardkit.sharding.mc_embedding_modules`), with two differences for serving: the MC collection is
kept in eval mode (no profiling, no eviction, so slots are the trained model's), and ``forward``
returns the embeddings only, as the unsharded quantized MC modules do.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.quant.mc_modules import (
    QuantManagedCollisionEmbeddingBagCollection,
    QuantManagedCollisionEmbeddingCollection,
)
from shardkit.sharding.kjt_list import KJTList
from shardkit.sharding.mc_embedding_modules import (
    BaseManagedCollisionContext,
    BaseManagedCollisionEmbeddingCollectionSharder,
    BaseShardedManagedCollisionEmbeddingCollection,
)
from shardkit.sharding.mc_modules import ManagedCollisionCollectionSharder
from shardkit.sharding.quant_embedding import QuantEmbeddingCollectionSharder
from shardkit.sharding.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from shardkit.sharding.types import EmbeddingModuleShardingPlan, ModuleSharder


class _ShardedQuantMC(BaseShardedManagedCollisionEmbeddingCollection):
    """See the module docstring."""

    def __init__(
        self,
        module,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        e_sharder: ModuleSharder,
        mc_sharder: ManagedCollisionCollectionSharder,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__(module, table_name_to_parameter_sharding, e_sharder, mc_sharder, env, device)
        self.train(False)

    def train(self, mode: bool = True):
        super().train(mode)
        self._managed_collision_collection.eval()  # serving never profiles or evicts
        return self

    def output_dist(self, ctx: BaseManagedCollisionContext, output: List[torch.Tensor]):
        return super().output_dist(ctx, output)[0]

    def compute_and_output_dist(self, ctx: BaseManagedCollisionContext, input: KJTList):
        return super().compute_and_output_dist(ctx, input)[0]

    def forward(self, *args, **kwargs):
        with torch.no_grad():
            return super().forward(*args, **kwargs)


class ShardedQuantManagedCollisionEmbeddingCollection(_ShardedQuantMC):
    """A :class:`QuantManagedCollisionEmbeddingCollection` placed by a plan; forward ->
    ``LazyAwaitable[Dict[str, JaggedTensor]]``, equal to the unsharded module's."""


class ShardedQuantManagedCollisionEmbeddingBagCollection(_ShardedQuantMC):
    """A :class:`QuantManagedCollisionEmbeddingBagCollection` placed by a plan; forward ->
    ``LazyAwaitable[KeyedTensor]``, equal to the unsharded module's (to fp32 reassociation, row-wise)."""


class QuantManagedCollisionEmbeddingCollectionSharder(BaseManagedCollisionEmbeddingCollectionSharder):
    """Shards a quantized MC-EC (table-wise, row-wise, column-wise; quantized kernels)."""

    sharded_type = ShardedQuantManagedCollisionEmbeddingCollection

    def __init__(
        self,
        e_sharder: Optional[QuantEmbeddingCollectionSharder] = None,
        mc_sharder: Optional[ManagedCollisionCollectionSharder] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__(e_sharder or QuantEmbeddingCollectionSharder(), mc_sharder, qcomm_codecs_registry)

    @property
    def module_type(self) -> Type[QuantManagedCollisionEmbeddingCollection]:
        return QuantManagedCollisionEmbeddingCollection


class QuantManagedCollisionEmbeddingBagCollectionSharder(BaseManagedCollisionEmbeddingCollectionSharder):
    """Shards a quantized MC-EBC (table-wise, row-wise, column-wise; quantized kernels)."""

    sharded_type = ShardedQuantManagedCollisionEmbeddingBagCollection

    def __init__(
        self,
        e_sharder: Optional[QuantEmbeddingBagCollectionSharder] = None,
        mc_sharder: Optional[ManagedCollisionCollectionSharder] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__(e_sharder or QuantEmbeddingBagCollectionSharder(), mc_sharder, qcomm_codecs_registry)

    @property
    def module_type(self) -> Type[QuantManagedCollisionEmbeddingBagCollection]:
        return QuantManagedCollisionEmbeddingBagCollection


__all__ = [
    "QuantManagedCollisionEmbeddingBagCollectionSharder",
    "QuantManagedCollisionEmbeddingCollectionSharder",
    "ShardedQuantManagedCollisionEmbeddingBagCollection",
    "ShardedQuantManagedCollisionEmbeddingCollection",
]
