"""FeatureProcessedEmbeddingBagCollection: feature processors in front of a weighted EBC."""

from __future__ import annotations

from typing import Dict, Mapping

import torch
from torch import nn

from shardkit.modules.embedding_bag_collection import EmbeddingBagCollection
from shardkit.modules.feature_processor import FeatureProcessor
from shardkit.sparse import KeyedJaggedTensor, KeyedTensor


class FeatureProcessedEmbeddingBagCollection(nn.Module):
    """Runs ``feature_processors[f]`` on feature f, then the (weighted) EmbeddingBagCollection.

    Args:
        embedding_bag_collection: must be built with ``is_weighted=True``.
        feature_processors: feature name -> processor; each name must be a feature of the collection.
            Features without a processor keep the input's weights, or weight 1 if it has none.

    forward(features) -> KeyedTensor, as the wrapped collection's.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        feature_processors: Mapping[str, FeatureProcessor],
    ) -> None:
        super().__init__()
        if not embedding_bag_collection.is_weighted():
            raise ValueError(
                "FeatureProcessedEmbeddingBagCollection needs an EmbeddingBagCollection(is_weighted=True)"
            )
        known = embedding_bag_collection.feature_names()
        unknown = [f for f in feature_processors if f not in known]
        if unknown:
            raise KeyError(f"feature processors for unknown feature(s) {unknown}; known features: {known}")
        self._embedding_bag_collection = embedding_bag_collection
        self._feature_processors = nn.ModuleDict(dict(feature_processors))

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self._embedding_bag_collection(self._process(features))

    def _process(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The same KJT with each processed feature's weights replaced (one concatenation)."""
        values = features.values()
        original = features.weights_or_none()
        counts = features.length_per_key()
        pieces = original.split(counts) if original is not None else None
        jt_dict: Dict[str, object] = features.to_dict()
        weights = []
        for i, key in enumerate(features.keys()):
            if key in self._feature_processors:
                weights.append(self._feature_processors[key](jt_dict[key]).weights())
            elif pieces is not None:
                weights.append(pieces[i])
            else:
                weights.append(torch.ones(counts[i], device=values.device))
        return KeyedJaggedTensor(
            features.keys(),
            values,
            torch.cat(weights) if weights else torch.ones(0, device=values.device),
            lengths=features.lengths(),
            stride=features.stride(),
            stride_per_key_per_rank=features.stride_per_key_per_rank()
            if features.variable_stride_per_key()
            else None,
            offset_per_key=features.offset_per_key(),
            inverse_indices=features.inverse_indices_or_none(),
            validate=False,
        )

    def reset_parameters(self) -> None:
        """Re-initialize the tables and the processors (after meta construction and ``to_empty``)."""
        self._embedding_bag_collection.reset_parameters()
        for processor in self._feature_processors.values():
            processor.reset_parameters()

    @property
    def embedding_bag_collection(self) -> EmbeddingBagCollection:
        return self._embedding_bag_collection
