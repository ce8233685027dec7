"""Sharded quantized EmbeddingCollection (sequence outputs) for inference (torchrec's
``torchrec.distributed.quant_embedding``).

:class:`ShardedQuantEmbeddingCollection` is the float sharded collection (plan checks, input dist,
sequence output dist, ``{feature: JaggedTensor}`` assembly) over the inference sequence shardings of
:mod:`shardkit.sharding.quant_sharding`: each rank holds its shards as quantized rows cut out of the
unsharded module's stored rows (no re-quantization) and dequantizes only the rows its ids read, so the
output equals the unsharded :class:`~shardkit.quant.QuantEmbeddingCollection`'s exactly (a sequence
lookup has no sums to reassociate). Table-wise, row-wise, column-wise; kernels ``quant``, ``quant_uvm``,
``quant_uvm_caching``. Inference only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import torch
from torch import nn

from shardkit.distributed.awaitable import LazyAwaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingConfig
from shardkit.quant import QuantEmbeddingCollection
from shardkit.sharding.embedding import ShardedEmbeddingCollection
from shardkit.sharding.quant_embeddingbag import (
    QUANT_KERNELS,
    BaseQuantEmbeddingSharder,
    QuantServing,
    check_quantized_module,
)
from shardkit.sharding.quant_sharding import INFER_SEQUENCE_SHARDINGS
from shardkit.sharding.types import EmbeddingModuleShardingPlan
from shardkit.sparse import JaggedTensor


class _ConvertedSequences(LazyAwaitable[Dict[str, JaggedTensor]]):
    """The module's ``{feature: JaggedTensor}`` with values converted to ``dtype``."""

    def __init__(self, inner: LazyAwaitable[Dict[str, JaggedTensor]], dtype: torch.dtype) -> None:
        super().__init__()
        self._inner, self._dtype = inner, dtype

    def _wait_impl(self) -> Dict[str, JaggedTensor]:
        return {
            k: JaggedTensor(
                jt.values().to(self._dtype), jt.weights_or_none(), lengths=jt.lengths(), validate=False
            )
            for k, jt in self._inner.wait().items()
        }


class ShardedQuantEmbeddingCollection(QuantServing, ShardedEmbeddingCollection):
    """A :class:`~shardkit.quant.QuantEmbeddingCollection` whose tables are placed by a plan.

    Args:
        module: the unsharded quantized module (its stored rows are copied).
        table_name_to_parameter_sharding: table -> ``ParameterSharding`` (table-wise, row-wise or
            column-wise; a quantized kernel), every table of ``module``.
        env: the world. fused_params: must be None or empty (nothing is trained). device: where this
            rank's shards live.

    forward(features: this rank's KJT) -> ``LazyAwaitable[Dict[str, JaggedTensor]]``: the unsharded
    module's output on these samples (values ``[ids, dim]`` in its ``output_dtype``).
    """

    sharding_classes = INFER_SEQUENCE_SHARDINGS
    supported_kernels = QUANT_KERNELS

    def __init__(
        self,
        module: QuantEmbeddingCollection,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        fused_params: Optional[Dict[str, Any]] = None,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        check_quantized_module(type(self).__name__, module, QuantEmbeddingCollection, fused_params)
        super().__init__(module, table_name_to_parameter_sharding, env, device, qcomm_codecs_registry)
        self._output_dtype = module.output_dtype

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return [t.config for t in self._tables]

    def forward(self, *input, **kwargs) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        with torch.no_grad():
            out = super().forward(*input, **kwargs)
        return out if self._output_dtype == torch.float32 else _ConvertedSequences(out, self._output_dtype)


class QuantEmbeddingCollectionSharder(BaseQuantEmbeddingSharder[QuantEmbeddingCollection]):
    """Shards a :class:`~shardkit.quant.QuantEmbeddingCollection` (torchrec's sharder of that name)."""

    @property
    def module_type(self) -> Type[QuantEmbeddingCollection]:
        return QuantEmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(INFER_SEQUENCE_SHARDINGS)

    def shard(
        self,
        module: QuantEmbeddingCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedQuantEmbeddingCollection:
        return ShardedQuantEmbeddingCollection(module, params, env, self._fused_params, device)

    def shardable_parameters(self, module: QuantEmbeddingCollection) -> Dict[str, nn.Parameter]:
        """Table name -> its stored rows (uint8 ``[rows, row_bytes]``)."""
        return {
            t.name: module.table_weight(t.name)
            for t in module.embedding_configs()
            if self._shardable_params is None or t.name in self._shardable_params
        }


__all__ = ["QuantEmbeddingCollectionSharder", "ShardedQuantEmbeddingCollection"]
