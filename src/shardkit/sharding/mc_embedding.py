"""ShardedManagedCollisionEmbeddingCollection and its sharder (the specification's ``mc_embedding``)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

from shardkit.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.mc_embedding_modules import (
    BaseManagedCollisionContext,
    BaseManagedCollisionEmbeddingCollectionSharder,
    BaseShardedManagedCollisionEmbeddingCollection,
)
from shardkit.sharding.mc_modules import ManagedCollisionCollectionSharder


class ManagedCollisionEmbeddingCollectionContext(BaseManagedCollisionContext):
    """Context of one forward: ``evictions_per_table``, ``remapped_kjt`` and the inner contexts."""


class ShardedManagedCollisionEmbeddingCollection(BaseShardedManagedCollisionEmbeddingCollection):
    """A ManagedCollisionEmbeddingCollection placed by a plan; forward ->
    ``(LazyAwaitable[Dict[str, JaggedTensor]], remapped KJT or None)``, equal to the unsharded equivalent."""

    context_type = ManagedCollisionEmbeddingCollectionContext


class ManagedCollisionEmbeddingCollectionSharder(BaseManagedCollisionEmbeddingCollectionSharder):
    """Shards an MC-EC (ROW_WISE, TABLE_WISE, COLUMN_WISE tables)."""

    sharded_type = ShardedManagedCollisionEmbeddingCollection

    def __init__(
        self,
        ec_sharder: Optional[EmbeddingCollectionSharder] = None,
        mc_sharder: Optional[ManagedCollisionCollectionSharder] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__(
            ec_sharder or EmbeddingCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry),
            mc_sharder,
            qcomm_codecs_registry,
        )

    @property
    def module_type(self) -> Type[ManagedCollisionEmbeddingCollection]:
        return ManagedCollisionEmbeddingCollection


__all__ = [
    "ManagedCollisionEmbeddingCollectionContext",
    "ManagedCollisionEmbeddingCollectionSharder",
    "ShardedManagedCollisionEmbeddingCollection",
]
