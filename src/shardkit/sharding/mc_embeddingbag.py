"""ShardedManagedCollisionEmbeddingBagCollection and its sharder (the specification's ``mc_embeddingbag``)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

from shardkit.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.mc_embedding_modules import (
    BaseManagedCollisionContext,
    BaseManagedCollisionEmbeddingCollectionSharder,
    BaseShardedManagedCollisionEmbeddingCollection,
)
from shardkit.sharding.mc_modules import ManagedCollisionCollectionSharder


class ManagedCollisionEmbeddingBagCollectionContext(BaseManagedCollisionContext):
    """Context of one forward: ``evictions_per_table``, ``remapped_kjt`` and the inner contexts."""

    def __init__(self) -> None:
        super().__init__()
        self.inverse_indices = None
        self.variable_batch_per_feature = False


class ShardedManagedCollisionEmbeddingBagCollection(BaseShardedManagedCollisionEmbeddingCollection):
    """A ManagedCollisionEmbeddingBagCollection placed by a plan; forward ->
    ``(LazyAwaitable[KeyedTensor], remapped KJT or None)``, equal to the unsharded equivalent."""

    context_type = ManagedCollisionEmbeddingBagCollectionContext


class ManagedCollisionEmbeddingBagCollectionSharder(BaseManagedCollisionEmbeddingCollectionSharder):
    """Shards an MC-EBC (ROW_WISE, TABLE_WISE, COLUMN_WISE tables)."""

    sharded_type = ShardedManagedCollisionEmbeddingBagCollection

    def __init__(
        self,
        ebc_sharder: Optional[EmbeddingBagCollectionSharder] = None,
        mc_sharder: Optional[ManagedCollisionCollectionSharder] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__(
            ebc_sharder or EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry),
            mc_sharder,
            qcomm_codecs_registry,
        )

    @property
    def module_type(self) -> Type[ManagedCollisionEmbeddingBagCollection]:
        return ManagedCollisionEmbeddingBagCollection


__all__ = [
    "ManagedCollisionEmbeddingBagCollectionContext",
    "ManagedCollisionEmbeddingBagCollectionSharder",
    "ShardedManagedCollisionEmbeddingBagCollection",
]
