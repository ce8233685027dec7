"""Managed-collision embedding modules: remap raw ids to slots, reset evicted rows, then look up.

``ManagedCollisionEmbeddingBagCollection`` / ``ManagedCollisionEmbeddingCollection`` wrap an
EmbeddingBagCollection / EmbeddingCollection and a ManagedCollisionCollection over the same tables.
forward(features) -> ``(embeddings, remapped features or None)``:

1. ``remapped = managed_collision_collection(features)`` (training: profile, maybe evict);
2. the slots evicted in step 1 get fresh rows and zeroed fused optimizer state
   (:mod:`shardkit.modules.mc_row_reset`), reported in ``evictions_per_table``;
3. ``embeddings = embedding_module(remapped)``.

Step 2 runs before the lookup, so an id that just got a slot is looked up in its fresh row.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
from torch import nn

from shardkit.modules.embedding_bag_collection import EmbeddingBagCollection
from shardkit.modules.embedding_collection import EmbeddingCollection
from shardkit.modules.mc_collection import ManagedCollisionCollection
from shardkit.modules.mc_row_reset import reset_rows_
from shardkit.modules.tracing import is_fx_proxy, refuse_script, traced_leaf
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


class BaseManagedCollisionEmbeddingCollection(nn.Module):
    """An embedding collection behind a managed collision collection (see the module docstring).

    Args:
        embedding_module: the EmbeddingBagCollection / EmbeddingCollection.
        managed_collision_collection: one module per table, same tables (configs equal).
        return_remapped_features: also return the remapped KJT.
        allow_in_place_embed_weight_update: accepted for compatibility; evicted rows are always
            written in place under ``no_grad`` (the autograd graph is not modified).

    ``evictions_per_table``: ``{table: evicted slots or None}`` of the last forward.
    """

    def __init__(
        self,
        embedding_module: Union[EmbeddingBagCollection, EmbeddingCollection],
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__()
        configs = (
            embedding_module.embedding_bag_configs()
            if isinstance(embedding_module, EmbeddingBagCollection)
            else embedding_module.embedding_configs()
        )
        mc_configs = managed_collision_collection.embedding_configs()
        if [c.name for c in configs] != [c.name for c in mc_configs] or configs != mc_configs:
            raise ValueError(
                f"the embedding module's tables {[c.name for c in configs]} and the managed collision "
                f"collection's {[c.name for c in mc_configs]} must have equal configs"
            )
        self._embedding_module = embedding_module
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = return_remapped_features
        self._allow_in_place_embed_weight_update = allow_in_place_embed_weight_update
        self.evictions_per_table: Dict[str, Optional[torch.Tensor]] = {}

    @property
    def fused_optimizer(self):
        """The embedding module's fused optimizer (``ValueError`` if it was built without one)."""
        return self._embedding_module.fused_optimizer

    def __prepare_scriptable__(self) -> None:
        refuse_script(self)

    def is_weighted(self) -> bool:
        return bool(getattr(self._embedding_module, "is_weighted", lambda: False)())

    def forward(
        self, features: KeyedJaggedTensor
    ) -> Tuple[Union[KeyedTensor, Dict[str, JaggedTensor]], Optional[KeyedJaggedTensor]]:
        if is_fx_proxy(features):  # torch.fx: one leaf call (shardkit.modules.tracing)
            return traced_leaf(self, features)
        remapped = self._managed_collision_collection(features)
        self.evictions_per_table = self._managed_collision_collection.evict()
        self._reset_evicted_rows(self.evictions_per_table)
        embeddings = self._embedding_module(remapped)
        return embeddings, (remapped if self._return_remapped_features else None)

    def _reset_evicted_rows(self, evictions: Dict[str, Optional[torch.Tensor]]) -> None:
        modules = self._managed_collision_collection._managed_collision_modules
        for table, slots in evictions.items():
            if slots is None:
                continue
            iteration = int(modules[table]._current_iter_tensor)
            for lookup in self._embedding_module.lookups:
                reset_rows_(lookup, table, slots, iteration)


class ManagedCollisionEmbeddingBagCollection(BaseManagedCollisionEmbeddingCollection):
    """MC + EmbeddingBagCollection: forward -> ``(KeyedTensor, remapped KJT or None)``."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__(
            embedding_bag_collection,
            managed_collision_collection,
            return_remapped_features,
            allow_in_place_embed_weight_update,
        )

    @property
    def _embedding_bag_collection(self) -> EmbeddingBagCollection:
        return self._embedding_module


class ManagedCollisionEmbeddingCollection(BaseManagedCollisionEmbeddingCollection):
    """MC + EmbeddingCollection: forward -> ``({feature: JaggedTensor}, remapped KJT or None)``."""

    def __init__(
        self,
        embedding_collection: EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__(
            embedding_collection,
            managed_collision_collection,
            return_remapped_features,
            allow_in_place_embed_weight_update,
        )

    @property
    def _embedding_collection(self) -> EmbeddingCollection:
        return self._embedding_module


__all__ = [
    "BaseManagedCollisionEmbeddingCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
]
