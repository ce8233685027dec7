"""torchrec's ``get_default_sharders`` / ``get_module_to_default_sharders``: one sharder per shardable
module type, what ``DistributedModelParallel`` uses when given no sharders."""

from __future__ import annotations

from typing import Dict, List, Type

from torch import nn

from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from shardkit.sharding.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from shardkit.sharding.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from shardkit.sharding.quant_embedding import QuantEmbeddingCollectionSharder
from shardkit.sharding.quant_embeddingbag import (
    QuantEmbeddingBagCollectionSharder,
    QuantFeatureProcessedEmbeddingBagCollectionSharder,
)
from shardkit.sharding.quant_mc_embedding import (
    QuantManagedCollisionEmbeddingBagCollectionSharder,
    QuantManagedCollisionEmbeddingCollectionSharder,
)
from shardkit.sharding.types import ModuleSharder


def get_default_sharders() -> List[ModuleSharder[nn.Module]]:
    """A fresh sharder (no fused_params, no codecs) for each module type shardkit shards: the embedding
    bag / embedding / feature-processed / managed-collision collections and the quantized ones. The
    managed-collision sharders are needed too: without them the inner collection of an MC module
    would be sharded alone and its maps would see only each rank's own ids."""
    return [
        EmbeddingBagCollectionSharder(),
        FeatureProcessedEmbeddingBagCollectionSharder(),
        EmbeddingCollectionSharder(),
        ManagedCollisionEmbeddingBagCollectionSharder(),
        ManagedCollisionEmbeddingCollectionSharder(),
        QuantEmbeddingBagCollectionSharder(),
        QuantFeatureProcessedEmbeddingBagCollectionSharder(),
        QuantEmbeddingCollectionSharder(),
        QuantManagedCollisionEmbeddingBagCollectionSharder(),
        QuantManagedCollisionEmbeddingCollectionSharder(),
    ]


def get_module_to_default_sharders() -> Dict[Type[nn.Module], ModuleSharder[nn.Module]]:
    """``{module type: its default sharder}``."""
    return {sharder.module_type: sharder for sharder in get_default_sharders()}


__all__ = ["get_default_sharders", "get_module_to_default_sharders"]
