"""Quantized managed-collision collections for inference (torchrec.quant's
``QuantManagedCollisionEmbeddingCollection``, and the bag variant).

A managed collision collection remaps raw ids to table slots, then the quantized collection looks the
slots up. Serving never profiles or evicts: the MC collection is kept in eval mode (torchrec's
``reset_inference_mode``), whatever ``train()`` is called with, so a served model's slots are the
trained model's. ``forward`` returns what the quantized collection returns (``{feature: JaggedTensor}``
or a ``KeyedTensor``), as torchrec's does.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Union

import torch

from shardkit.modules import DataType, EmbeddingBagConfig, EmbeddingConfig
from shardkit.modules.mc_collection import ManagedCollisionCollection
from shardkit.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from shardkit.modules.tracing import is_fx_proxy, traced_leaf
from shardkit.quant.embedding_modules import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


class _InferenceRemap:
    """The MC collection in front of a quantized collection, held in eval mode."""

    def _init_mc(
        self,
        managed_collision_collection: Optional[ManagedCollisionCollection],
        return_remapped_features: bool,
    ) -> None:
        if managed_collision_collection is None:
            raise ValueError(f"{type(self).__name__} needs a managed_collision_collection")
        mine = [(c.name, c.num_embeddings) for c in self._tables]
        theirs = [(c.name, c.num_embeddings) for c in managed_collision_collection.embedding_configs()]
        if mine != theirs:
            raise ValueError(
                f"{type(self).__name__}: the quantized tables {mine} and the managed collision collection's "
                f"{theirs} must be the same tables (names and sizes)"
            )
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = return_remapped_features
        managed_collision_collection.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        self._managed_collision_collection.eval()  # serving never profiles or evicts
        return self

    # what the MC sharders read of an MC module: the embedding module (here the collection itself)
    @property
    def _embedding_module(self):
        return self

    _allow_in_place_embed_weight_update = False

    def forward(self, features: KeyedJaggedTensor):
        if is_fx_proxy(features):  # torch.fx: one leaf call (remap + lookup), not two
            return traced_leaf(self, features)
        return super().forward(self._managed_collision_collection(features))

    @classmethod
    def _from_mc_float(cls, module, quant_type, data_type, output_dtype, return_remapped_features, **kwargs):
        quantized = quant_type.from_float(module._embedding_module, data_type, output_dtype)
        served = cls(
            [copy.deepcopy(t) for t in quantized._tables],
            device=quantized.device,
            output_dtype=quantized.output_dtype,
            managed_collision_collection=copy.deepcopy(module._managed_collision_collection),
            return_remapped_features=(
                module._return_remapped_features
                if return_remapped_features is None
                else return_remapped_features
            ),
            **kwargs,
        )
        with torch.no_grad():
            for table in quantized._tables:
                served.table_weight(table.name).copy_(quantized.table_weight(table.name))
        return served


class QuantManagedCollisionEmbeddingCollection(_InferenceRemap, QuantEmbeddingCollection):
    """MC remap + :class:`QuantEmbeddingCollection`: forward -> ``{feature: JaggedTensor}``.

    Args: the quantized collection's (``tables``, ``device``, ``need_indices``, ``output_dtype``,
    ``table_name_to_quantized_weights``), ``managed_collision_collection`` (required; same tables),
    ``return_remapped_features`` (kept for torchrec's signature; forward returns the embeddings only).
    """

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: Optional[torch.device] = None,
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float32,
        table_name_to_quantized_weights=None,
        managed_collision_collection: Optional[ManagedCollisionCollection] = None,
        return_remapped_features: bool = False,
    ) -> None:
        super().__init__(tables, device, need_indices, output_dtype, table_name_to_quantized_weights)
        self._init_mc(managed_collision_collection, return_remapped_features)

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        return super().forward(features)

    @classmethod
    def from_float(
        cls,
        module: ManagedCollisionEmbeddingCollection,
        return_remapped_features: Optional[bool] = None,
        data_type: Optional[DataType] = None,
        output_dtype: Optional[torch.dtype] = None,
    ) -> QuantManagedCollisionEmbeddingCollection:
        """The trained MC-EC quantized (tables as ``QuantEmbeddingCollection.from_float``; the MC
        collection copied with its maps)."""
        return cls._from_mc_float(
            module,
            QuantEmbeddingCollection,
            data_type,
            output_dtype,
            return_remapped_features,
            need_indices=module._embedding_module.need_indices(),
        )


class QuantManagedCollisionEmbeddingBagCollection(_InferenceRemap, QuantEmbeddingBagCollection):
    """MC remap + :class:`QuantEmbeddingBagCollection`: forward -> ``KeyedTensor``.

    Args: as :class:`QuantManagedCollisionEmbeddingCollection`, with the bag collection's
    ``is_weighted`` instead of ``need_indices``.
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        device: Optional[torch.device] = None,
        is_weighted: bool = False,
        output_dtype: torch.dtype = torch.float32,
        table_name_to_quantized_weights=None,
        managed_collision_collection: Optional[ManagedCollisionCollection] = None,
        return_remapped_features: bool = False,
    ) -> None:
        super().__init__(
            tables,
            is_weighted=is_weighted,
            device=device,
            output_dtype=output_dtype,
            table_name_to_quantized_weights=table_name_to_quantized_weights,
        )
        self._init_mc(managed_collision_collection, return_remapped_features)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return super().forward(features)

    @classmethod
    def from_float(
        cls,
        module: ManagedCollisionEmbeddingBagCollection,
        return_remapped_features: Optional[bool] = None,
        data_type: Optional[DataType] = None,
        output_dtype: Optional[torch.dtype] = None,
    ) -> QuantManagedCollisionEmbeddingBagCollection:
        """The trained MC-EBC quantized (see the EC variant)."""
        return cls._from_mc_float(
            module,
            QuantEmbeddingBagCollection,
            data_type,
            output_dtype,
            return_remapped_features,
            is_weighted=module._embedding_module.is_weighted(),
        )


QuantMCModule = Union[QuantManagedCollisionEmbeddingCollection, QuantManagedCollisionEmbeddingBagCollection]

__all__ = ["QuantManagedCollisionEmbeddingBagCollection", "QuantManagedCollisionEmbeddingCollection"]
