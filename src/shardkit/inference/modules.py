"""torchrec's ``torchrec.inference.modules`` in shardkit.

The inference path's names at torchrec's path (docs/serving.md); each is defined in its own module of
``shardkit.inference``.
"""

from shardkit.inference.predict_module import (
    BatchingMetadata,
    PredictFactory,
    PredictModule,
    QualNameMetadata,
)
from shardkit.inference.quantize import (
    DEFAULT_QUANTIZATION_DTYPE,
    DEFAULT_QUANTIZATION_MAPPING,
    quantize_embeddings,
    quantize_inference_model,
)
from shardkit.inference.shard_quant import shard_quant_model

__all__ = [
    "BatchingMetadata",
    "DEFAULT_QUANTIZATION_DTYPE",
    "DEFAULT_QUANTIZATION_MAPPING",
    "PredictFactory",
    "PredictModule",
    "QualNameMetadata",
    "quantize_embeddings",
    "quantize_inference_model",
    "shard_quant_model",
]
