"""Sharded quantized EmbeddingBagCollections for inference (the specification's ``quant_embeddingbag``).

:class:`ShardedQuantEmbeddingBagCollection` is ``ShardedEmbeddingBagCollection`` (the same plan
checks, input dist, output dist and KeyedTensor assembly) over the inference shardings of
:mod:`shardkit.sharding.quant_sharding`: each rank holds its shards as quantized rows and dequantizes
only the rows it reads. Sharding types: table-wise, row-wise, column-wise; compute kernel: ``quant``
(``quant_uvm`` / ``quant_uvm_caching``: the rows in a backing file, read directly or through a row
cache, ``shardkit.quant.offloaded_quant_lookup``). Anything else in a plan is a
``ValueError`` on every rank, at construction.

Inference only: no gradients, no optimizer, ``forward`` runs without autograd.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import torch
from torch import nn

from shardkit.distributed.awaitable import LazyAwaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagConfig
from shardkit.quant import QuantEmbeddingBagCollection, QuantFeatureProcessedEmbeddingBagCollection
from shardkit.sharding.embeddingbag import ShardedEmbeddingBagCollection
from shardkit.sharding.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
from shardkit.sharding.quant_sharding import INFER_POOLED_SHARDINGS, create_infer_embedding_bag_sharding
from shardkit.sharding.types import EmbeddingComputeKernel, EmbeddingModuleShardingPlan, M, ModuleSharder
from shardkit.sparse import KeyedJaggedTensor, KeyedTensor

QUANT_KERNELS = tuple(
    k.value
    for k in (
        EmbeddingComputeKernel.QUANT,
        EmbeddingComputeKernel.QUANT_UVM,
        EmbeddingComputeKernel.QUANT_UVM_CACHING,
    )
)


def flatten_feature_lengths(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``features`` with 1-D lengths (torchrec flattens a KJT whose lengths are ``[F, B]``).

    A shardkit KeyedJaggedTensor always holds 1-D lengths (its constructor checks them), so this
    returns ``features`` itself; it exists for programs written against torchrec that call it.
    """
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"flatten_feature_lengths takes a KeyedJaggedTensor, got {type(features).__name__}")
    return features


class _Converted(LazyAwaitable[KeyedTensor]):
    """The module's KeyedTensor with values converted to ``dtype``."""

    def __init__(self, inner: LazyAwaitable[KeyedTensor], dtype: torch.dtype) -> None:
        super().__init__()
        self._inner, self._dtype = inner, dtype

    def _wait_impl(self) -> KeyedTensor:
        out = self._inner.wait()
        return KeyedTensor(out.keys(), out.length_per_key(), out.values().to(self._dtype))


def check_quantized_module(
    owner: str, module: Any, quant_type: type, fused_params: Optional[Dict[str, Any]]
) -> None:
    """TypeError unless ``module`` is a ``quant_type`` (naming ``from_float``), ValueError for
    ``fused_params`` (a sharded quantized module serves inference)."""
    if not isinstance(module, quant_type):
        raise TypeError(
            f"{owner} shards a {quant_type.__name__}, got {type(module).__name__}; "
            f"quantize the trained module first ({quant_type.__name__}.from_float)"
        )
    if fused_params:
        raise ValueError(f"{owner} serves inference: fused_params {fused_params} do not apply")


class QuantServing:
    """What the sharded quantized collections share: the unsharded module's ``output_dtype``
    (``_output_dtype``, set by the subclass) and no state dict."""

    _output_dtype: torch.dtype

    @property
    def output_dtype(self) -> torch.dtype:
        return self._output_dtype

    def state_dict(self, *args, **kwargs):
        """Not supported: a shard holds stored rows (a column block with its own copy of each row's
        scale and bias), which no table-shaped DTensor describes. ``ValueError`` saying what to do."""
        raise ValueError(
            f"{type(self).__name__} has no state dict: save the trained float model (DCP / "
            "shardkit.checkpoint) and convert it (shardkit.sharding.quant_convert.quantize_sharded, "
            "docs/quant.md), or read this rank's stored rows with local_shards()"
        )


class ShardedQuantEmbeddingBagCollection(QuantServing, ShardedEmbeddingBagCollection):
    """A :class:`~shardkit.quant.QuantEmbeddingBagCollection` whose tables are placed by a plan.

    Args:
        module: the unsharded quantized module (its stored rows are copied; a module on the meta
            device gives shards initialized from the configs, to be loaded later).
        table_name_to_parameter_sharding: table -> ``ParameterSharding`` (table-wise, row-wise or
            column-wise; kernel ``quant``), every table of ``module``.
        env: the world. fused_params: accepted for the specification's signature; must be None or
            empty (nothing is trained). device: where this rank's shards live.

    forward(features: this rank's KJT) -> ``LazyAwaitable[KeyedTensor]``: the unsharded quantized
    module's output on these samples, in its ``output_dtype``. Every rank must call forward.
    """

    sharding_classes = INFER_POOLED_SHARDINGS
    supported_kernels = QUANT_KERNELS

    def __init__(
        self,
        module: QuantEmbeddingBagCollection,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        fused_params: Optional[Dict[str, Any]] = None,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        check_quantized_module(type(self).__name__, module, QuantEmbeddingBagCollection, fused_params)
        super().__init__(module, table_name_to_parameter_sharding, env, device, qcomm_codecs_registry)
        self._output_dtype = module.output_dtype

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return [t.config for t in self._tables]

    def forward(self, *input, **kwargs) -> LazyAwaitable[KeyedTensor]:
        with torch.no_grad():
            return super().forward(*input, **kwargs)

    def _assemble(self, parts) -> LazyAwaitable[KeyedTensor]:
        out = super()._assemble(parts)
        return out if self._output_dtype == torch.float32 else _Converted(out, self._output_dtype)


class ShardedQuantFeatureProcessedEmbeddingBagCollection(
    ShardedFeatureProcessedEmbeddingBagCollection, ShardedQuantEmbeddingBagCollection
):
    """A :class:`~shardkit.quant.QuantFeatureProcessedEmbeddingBagCollection` placed by a plan
    (position-weighted processors, as ``ShardedFeatureProcessedEmbeddingBagCollection``)."""

    def __init__(
        self,
        module: QuantFeatureProcessedEmbeddingBagCollection,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        fused_params: Optional[Dict[str, Any]] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        if fused_params:
            raise ValueError(
                f"{type(self).__name__} serves inference: fused_params {fused_params} do not apply"
            )
        super().__init__(module, table_name_to_parameter_sharding, env, device=device)


class BaseQuantEmbeddingSharder(ModuleSharder[M]):
    """What the quantized sharders share: table-wise, row-wise and column-wise with the ``quant``
    kernel; ``shardable_params`` (table names) limits what a plan may shard."""

    def __init__(
        self, fused_params: Optional[Dict[str, Any]] = None, shardable_params: Optional[List[str]] = None
    ) -> None:
        super().__init__()
        self._fused_params = fused_params
        self._shardable_params = shardable_params

    @property
    def fused_params(self) -> Optional[Dict[str, Any]]:
        return self._fused_params

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(INFER_POOLED_SHARDINGS)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.QUANT.value]

    def _tables(self, module: QuantEmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        return {
            t.name: module.table_weight(t.name)
            for t in module.embedding_bag_configs()
            if self._shardable_params is None or t.name in self._shardable_params
        }


class QuantEmbeddingBagCollectionSharder(BaseQuantEmbeddingSharder[QuantEmbeddingBagCollection]):
    """Shards a :class:`~shardkit.quant.QuantEmbeddingBagCollection` (torchrec's sharder of that name;
    its ``module_type`` is the quantized collection, which torchrec also calls EmbeddingBagCollection)."""

    @property
    def module_type(self) -> Type[QuantEmbeddingBagCollection]:
        return QuantEmbeddingBagCollection

    def shard(
        self,
        module: QuantEmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedQuantEmbeddingBagCollection:
        return ShardedQuantEmbeddingBagCollection(module, params, env, self._fused_params, device)

    def shardable_parameters(self, module: QuantEmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        """Table name -> its stored rows (uint8 ``[rows, row_bytes]``)."""
        return self._tables(module)


class QuantFeatureProcessedEmbeddingBagCollectionSharder(
    BaseQuantEmbeddingSharder[QuantFeatureProcessedEmbeddingBagCollection]
):
    """Shards a :class:`~shardkit.quant.QuantFeatureProcessedEmbeddingBagCollection`."""

    @property
    def module_type(self) -> Type[QuantFeatureProcessedEmbeddingBagCollection]:
        return QuantFeatureProcessedEmbeddingBagCollection

    def shard(
        self,
        module: QuantFeatureProcessedEmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedQuantFeatureProcessedEmbeddingBagCollection:
        return ShardedQuantFeatureProcessedEmbeddingBagCollection(
            module, params, env, self._fused_params, device
        )

    def shardable_parameters(
        self, module: QuantFeatureProcessedEmbeddingBagCollection
    ) -> Dict[str, nn.Parameter]:
        return self._tables(module.embedding_bag_collection)


__all__ = [
    "BaseQuantEmbeddingSharder",
    "QuantEmbeddingBagCollectionSharder",
    "QuantFeatureProcessedEmbeddingBagCollectionSharder",
    "ShardedQuantEmbeddingBagCollection",
    "ShardedQuantFeatureProcessedEmbeddingBagCollection",
    "create_infer_embedding_bag_sharding",
    "flatten_feature_lengths",
]
