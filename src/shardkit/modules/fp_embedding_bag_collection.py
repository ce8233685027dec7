"""FeatureProcessedEmbeddingBagCollection: feature processors in front of a weighted EBC."""

from __future__ import annotations

from typing import Mapping, Tuple, Union

from torch import nn

from shardkit.modules.embedding_bag_collection import EmbeddingBagCollection
from shardkit.modules.feature_processor_ import (
    FeatureProcessor,
    FeatureProcessorDictWrapper,
    FeatureProcessorsCollection,
)
from shardkit.modules.tracing import is_fx_proxy, refuse_script, traced_leaf
from shardkit.sparse import KeyedJaggedTensor, KeyedTensor


class FeatureProcessedEmbeddingBagCollection(nn.Module):
    """Feature processors in front of a weighted EmbeddingBagCollection.

    Args:
        embedding_bag_collection: must be built with ``is_weighted=True``.
        feature_processors: either ``{feature: FeatureProcessor}`` (each name a feature of the
            collection; features without a processor keep the input's weights, or weight 1 if it has
            none), or one ``FeatureProcessorsCollection`` that weighs the whole KJT (e.g.
            ``PositionWeightedModuleCollection``), as torchrec.

    forward(features) -> KeyedTensor, as the wrapped collection's. ``split()`` returns the
    processors as one ``FeatureProcessorsCollection`` and the collection, as torchrec.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        feature_processors: Union[Mapping[str, FeatureProcessor], FeatureProcessorsCollection],
    ) -> None:
        super().__init__()
        if not embedding_bag_collection.is_weighted():
            raise ValueError(
                "FeatureProcessedEmbeddingBagCollection needs an EmbeddingBagCollection(is_weighted=True)"
            )
        self._embedding_bag_collection = embedding_bag_collection
        self._feature_processors: Union[nn.ModuleDict, FeatureProcessorsCollection]
        if isinstance(feature_processors, FeatureProcessorsCollection):
            self._feature_processors = feature_processors
            self._processor_collection = feature_processors
        else:
            known = embedding_bag_collection.feature_names()
            unknown = [f for f in feature_processors if f not in known]
            if unknown:
                raise KeyError(
                    f"feature processors for unknown feature(s) {unknown}; known features: {known}"
                )
            self._feature_processors = nn.ModuleDict(dict(feature_processors))
            # not a submodule: the processors stay under _feature_processors in the state dict
            object.__setattr__(
                self, "_processor_collection", FeatureProcessorDictWrapper(self._feature_processors)
            )

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if is_fx_proxy(features):  # torch.fx: one leaf call (shardkit.modules.tracing)
            return traced_leaf(self, features)
        return self._embedding_bag_collection(self._processor_collection(features))

    def __prepare_scriptable__(self) -> None:
        refuse_script(self)

    def split(self) -> Tuple[FeatureProcessorsCollection, EmbeddingBagCollection]:
        """``(processors as one collection, the embedding bag collection)``, as torchrec."""
        return self._processor_collection, self._embedding_bag_collection

    def is_weighted(self) -> bool:
        return self._embedding_bag_collection.is_weighted()

    def reset_parameters(self) -> None:
        """Re-initialize the tables and the processors (after meta construction and ``to_empty``)."""
        self._embedding_bag_collection.reset_parameters()
        processors = (
            [self._feature_processors]
            if isinstance(self._feature_processors, FeatureProcessorsCollection)
            else list(self._feature_processors.values())
        )
        for processor in processors:
            processor.reset_parameters()

    @property
    def embedding_bag_collection(self) -> EmbeddingBagCollection:
        return self._embedding_bag_collection
