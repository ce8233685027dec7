"""Quantized embedding modules for inference and their sharding (L2; docs/quant.md).

Tables are stored row-wise quantized (int8 / int4 / int2 codes with a per-row fp16 scale and bias in
the row, fbgemm's fused layout) or as fp16 / bf16, and looked up by a kernel that dequantizes only the
rows it reads (``shardkit.kernels.quant_embedding``). The sharded modules and their sharders are in
``shardkit.sharding.quant_embeddingbag``.
"""

from shardkit.quant.data_types import QuantConfig, dtype_to_data_type, quantized_data_types, storage_of
from shardkit.quant.embedding_modules import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
)
from shardkit.quant.mc_modules import (
    QuantManagedCollisionEmbeddingBagCollection,
    QuantManagedCollisionEmbeddingCollection,
)
from shardkit.quant.pruning import PrunedQuantEmbeddings, PruningReport, prune_rows
from shardkit.quant.quant_lookup import QuantGroupedEmbeddingLookup, quantize_into

__all__ = [
    "QuantConfig",
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingCollection",
    "QuantFeatureProcessedEmbeddingBagCollection",
    "QuantManagedCollisionEmbeddingBagCollection",
    "QuantManagedCollisionEmbeddingCollection",
    "QuantGroupedEmbeddingLookup",
    "PrunedQuantEmbeddings",
    "PruningReport",
    "prune_rows",
    "dtype_to_data_type",
    "quantize_into",
    "quantized_data_types",
    "storage_of",
]
