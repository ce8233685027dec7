"""Quantized embedding collections for inference (torchrec.quant's ``EmbeddingBagCollection``,
``EmbeddingCollection`` and ``FeatureProcessedEmbeddingBagCollection``).

Each is the float module with its groups stored by :class:`~shardkit.quant.quant_lookup.
QuantGroupedEmbeddingLookup`: tables as row-wise int8 / int4 / int2 (codes, fp16 scale and bias in
each row) or fp16 / bf16 / fp32, one ``uint8`` buffer per (dim, data type) group, looked up by a kernel
that dequantizes only the rows it reads. They have no parameters and no gradients; forward runs under
``torch.no_grad`` and works under ``torch.inference_mode``.

Build one from a trained module with ``from_float(module)`` (the data type of each table: see
:func:`~shardkit.quant.data_types.quantized_data_types`), or directly from configs whose
``data_type`` is the storage (rows initialized by the configs, then quantized).

State dict: ``embedding_bags.<table>.weight`` / ``embeddings.<table>.weight``, the table's stored rows
as uint8 ``[num_embeddings, row_bytes]`` (``shardkit.kernels.quant_rows.row_bytes``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from shardkit.kernels.quant_rows import SCALE_BIAS_BYTES
from shardkit.modules import DataType, EmbeddingBagConfig, EmbeddingConfig
from shardkit.modules import EmbeddingBagCollection as FloatEmbeddingBagCollection
from shardkit.modules import EmbeddingCollection as FloatEmbeddingCollection
from shardkit.modules import (
    FeatureProcessedEmbeddingBagCollection as FloatFeatureProcessedEmbeddingBagCollection,
)
from shardkit.modules.grouped_tables import GroupedTablesModule
from shardkit.modules.tracing import is_fx_proxy, traced_leaf
from shardkit.quant.data_types import QuantConfig, qconfig_output_dtype, quantized_data_types
from shardkit.quant.quant_lookup import QuantGroupedEmbeddingLookup, quantize_into
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

# torchrec's quantized weights: table -> (values uint8 [rows, bytes], scale/bias uint8 [rows, 4] or None)
QuantizedWeights = Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]


class _QuantTables:
    """What the quantized collections share: output dtype, loading quantized rows, quantizing a float
    module's tables into a new module."""

    lookup_class = QuantGroupedEmbeddingLookup

    def _init_quant(self, output_dtype: torch.dtype, weights: Optional[QuantizedWeights]) -> None:
        self._output_dtype = output_dtype
        if weights:
            self._load_quantized(weights)

    @property
    def output_dtype(self) -> torch.dtype:
        return self._output_dtype

    def table_storage(self, name: str) -> str:
        """The row storage of table ``name`` (``"int8"``, ``"fp16"``, ...)."""
        group, _ = self._locate(name)
        return self.lookups[group].storage

    @torch.no_grad()
    def _load_quantized(self, weights: QuantizedWeights) -> None:
        for name, (values, scale_bias) in weights.items():
            rows = values if scale_bias is None else torch.cat([values, scale_bias], dim=1)
            dst = self.table_weight(name)
            if rows.shape != dst.shape or rows.dtype != torch.uint8:
                raise ValueError(
                    f"table {name!r}: quantized rows must be uint8 {tuple(dst.shape)} "
                    f"(values then {SCALE_BIAS_BYTES} bytes of fp16 scale and bias for int types), "
                    f"got {rows.dtype} {tuple(rows.shape)}"
                )
            dst.copy_(rows)

    @torch.no_grad()
    def _quantize_tables_of(self, module: GroupedTablesModule) -> None:
        for table in self._tables:
            quantize_into(
                self.table_weight(table.name),
                module.table_weight(table.name).detach(),
                self.table_storage(table.name),
            )

    @classmethod
    def _from_float_module(cls, module: GroupedTablesModule, data_type, output_dtype, **kwargs):
        tables = (
            module.embedding_bag_configs()
            if hasattr(module, "embedding_bag_configs")
            else module.embedding_configs()
        )
        types = quantized_data_types(module, tables, data_type)
        configs = [dataclasses.replace(t, data_type=types[t.name]) for t in tables]
        device = next(module.parameters()).device
        output_dtype = output_dtype or qconfig_output_dtype(module) or torch.float32
        quantized = cls(configs, device=torch.device("meta"), output_dtype=output_dtype, **kwargs)
        quantized.to_empty(device=device)
        quantized._quantize_tables_of(module)
        return quantized


def _no_grad_forward(method):
    def forward(self, features: KeyedJaggedTensor):
        if is_fx_proxy(features):  # torch.fx: one leaf call (shardkit.modules.tracing)
            return traced_leaf(self, features)
        with torch.no_grad():
            return method(self, features)

    forward.__doc__ = method.__doc__
    return forward


class QuantEmbeddingBagCollection(_QuantTables, FloatEmbeddingBagCollection):
    """Pooled lookups of quantized tables (torchrec.quant's ``EmbeddingBagCollection``).

    Args:
        tables: ``EmbeddingBagConfig`` s; each ``data_type`` is its storage (INT8 / INT4 / INT2
            row-wise, FP16 / BF16 / FP32).
        is_weighted, device: as for :class:`~shardkit.modules.EmbeddingBagCollection`.
        output_dtype: dtype of the pooled output (the lookup accumulates in fp32, then converts).
        table_name_to_quantized_weights: optional stored rows to load, per table
            ``(values uint8 [rows, data bytes], scale_bias uint8 [rows, 4] or None)``.

    forward(features) -> KeyedTensor as the float module's, ``values`` in ``output_dtype``.
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        output_dtype: torch.dtype = torch.float32,
        table_name_to_quantized_weights: Optional[QuantizedWeights] = None,
    ) -> None:
        FloatEmbeddingBagCollection.__init__(self, tables, is_weighted, device)
        self._init_quant(output_dtype, table_name_to_quantized_weights)

    @classmethod
    def from_float(
        cls,
        module: FloatEmbeddingBagCollection,
        data_type: Optional[DataType] = None,
        output_dtype: Optional[torch.dtype] = None,
    ) -> QuantEmbeddingBagCollection:
        """A quantized copy of the trained ``module`` (not modified) on its device.

        data_type: one storage for every table; None: the module's ``qconfig`` (torchrec's rule), else
        each table config's ``data_type``. output_dtype: None: the ``qconfig``'s activation dtype, else fp32.
        """
        return cls._from_float_module(module, data_type, output_dtype, is_weighted=module.is_weighted())

    @_no_grad_forward
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        out = FloatEmbeddingBagCollection.forward(self, features)
        if out.values().dtype == self._output_dtype:
            return out
        return KeyedTensor(out.keys(), out.length_per_key(), out.values().to(self._output_dtype))


class QuantEmbeddingCollection(_QuantTables, FloatEmbeddingCollection):
    """Sequence lookups of quantized tables (torchrec.quant's ``EmbeddingCollection``).

    Args: as :class:`QuantEmbeddingBagCollection` (``EmbeddingConfig`` s; ``need_indices`` as the float
    module's). forward(features) -> ``{feature: JaggedTensor}``, values ``[ids, dim]`` in ``output_dtype``.
    """

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: Optional[torch.device] = None,
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float32,
        table_name_to_quantized_weights: Optional[QuantizedWeights] = None,
    ) -> None:
        FloatEmbeddingCollection.__init__(self, tables, device, need_indices)
        self._init_quant(output_dtype, table_name_to_quantized_weights)

    @classmethod
    def from_float(
        cls,
        module: FloatEmbeddingCollection,
        data_type: Optional[DataType] = None,
        output_dtype: Optional[torch.dtype] = None,
    ) -> QuantEmbeddingCollection:
        """A quantized copy of the trained ``module`` (arguments as the bag collection's ``from_float``)."""
        return cls._from_float_module(module, data_type, output_dtype, need_indices=module.need_indices())

    @_no_grad_forward
    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        out = FloatEmbeddingCollection.forward(self, features)
        if all(jt.values().dtype == self._output_dtype for jt in out.values()):
            return out
        return {
            k: JaggedTensor(
                jt.values().to(self._output_dtype), jt.weights_or_none(), lengths=jt.lengths(), validate=False
            )
            for k, jt in out.items()
        }


class QuantFeatureProcessedEmbeddingBagCollection(FloatFeatureProcessedEmbeddingBagCollection):
    """Feature processors in front of a weighted :class:`QuantEmbeddingBagCollection`
    (torchrec.quant's ``FeatureProcessedEmbeddingBagCollection``); inference only."""

    def __init__(self, embedding_bag_collection: QuantEmbeddingBagCollection, feature_processors) -> None:
        if not isinstance(embedding_bag_collection, QuantEmbeddingBagCollection):
            raise TypeError("QuantFeatureProcessedEmbeddingBagCollection wraps a QuantEmbeddingBagCollection")
        super().__init__(embedding_bag_collection, feature_processors)

    @classmethod
    def from_float(
        cls,
        module: FloatFeatureProcessedEmbeddingBagCollection,
        data_type: Optional[DataType] = None,
        output_dtype: Optional[torch.dtype] = None,
    ) -> QuantFeatureProcessedEmbeddingBagCollection:
        """The processors copied, the collection quantized (``qconfig`` read from ``module``, as torchrec)."""
        ebc = module.embedding_bag_collection
        if getattr(module, "qconfig", None) is not None and getattr(ebc, "qconfig", None) is None:
            ebc = copy.copy(ebc)
            ebc.qconfig = module.qconfig
        quantized = QuantEmbeddingBagCollection.from_float(ebc, data_type, output_dtype)
        processors = module._feature_processors
        # a processor collection (feature_processor_) is copied as one module; a dict, per feature
        if isinstance(processors, torch.nn.ModuleDict):
            processors = dict(processors)
        return cls(quantized, copy.deepcopy(processors))

    @_no_grad_forward
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return FloatFeatureProcessedEmbeddingBagCollection.forward(self, features)


# torchrec.quant.embedding_modules' spelling: torchrec programs import the quantized classes under the
# float classes' names from this module (the float ones stay in shardkit.modules).
EmbeddingBagCollection = QuantEmbeddingBagCollection
EmbeddingCollection = QuantEmbeddingCollection
FeatureProcessedEmbeddingBagCollection = QuantFeatureProcessedEmbeddingBagCollection

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "FeatureProcessedEmbeddingBagCollection",
    "QuantConfig",
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingCollection",
    "QuantFeatureProcessedEmbeddingBagCollection",
    "QuantizedWeights",
]
