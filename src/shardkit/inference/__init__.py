"""Serving a trained model: torchrec.inference's path in shardkit (L4; docs/serving.md).

- :mod:`~shardkit.inference.state_dict_transform`: ``state_dict_gather`` / ``state_dict_to_device``,
  a sharded state dict gathered onto one rank or moved to a device.
- :mod:`~shardkit.inference.predict_module`: ``PredictModule`` (torchrec's), requests batched into a KJT,
  results split back, bad requests refused one by one; ``DLRMPredictModule``.
- :mod:`~shardkit.inference.quantize`: ``quantize_embeddings`` / ``quantize_inference_model``, a
  trained model's collections swapped for ``shardkit.quant``'s.
- :mod:`~shardkit.inference.pruning`: ``prune_inference_model``, a quantized model's tables pruned
  (rows dropped, ids remapped; ``shardkit.quant.prune_rows``).
- :mod:`~shardkit.inference.package`: ``save_package`` / ``load_package``, weights + a JSON description
  that load in a fresh process.
- :mod:`~shardkit.inference.shard_quant`: ``shard_quant_model``, a quantized model sharded by the planner.
"""

from shardkit.inference.package import PackageError, load_package, save_package
from shardkit.inference.predict_module import (
    Answer,
    BatchingMetadata,
    DLRMPredictModule,
    PredictFactory,
    PredictModule,
    QualNameMetadata,
    Request,
    RequestBatcher,
    split_results,
)
from shardkit.inference.pruning import prune_inference_model
from shardkit.inference.quantize import (
    DEFAULT_QUANTIZATION_DTYPE,
    DEFAULT_QUANTIZATION_MAPPING,
    quantize_embeddings,
    quantize_inference_model,
)
from shardkit.inference.shard_quant import default_quant_sharders, shard_quant_model
from shardkit.inference.state_dict_transform import (
    state_dict_all_gather_keys,
    state_dict_gather,
    state_dict_to_device,
)

__all__ = [
    "Answer",
    "BatchingMetadata",
    "DEFAULT_QUANTIZATION_DTYPE",
    "DEFAULT_QUANTIZATION_MAPPING",
    "DLRMPredictModule",
    "PackageError",
    "PredictFactory",
    "PredictModule",
    "QualNameMetadata",
    "Request",
    "RequestBatcher",
    "default_quant_sharders",
    "load_package",
    "prune_inference_model",
    "quantize_embeddings",
    "quantize_inference_model",
    "save_package",
    "shard_quant_model",
    "split_results",
    "state_dict_all_gather_keys",
    "state_dict_gather",
    "state_dict_to_device",
]
