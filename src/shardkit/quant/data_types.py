"""Which storage a quantized module gives each table, from the table configs or a ``qconfig``.

``shardkit.kernels.quant_rows`` names the storages (``"int8"``, ``"fp16"``, ...); the modules name them
by ``DataType``. ``from_float`` decides each table's data type as torchrec's does when the float module
carries a ``qconfig`` (its weight observer's dtype for every table, ``per_table_weight_dtype``
overriding it per table name), else from each table config's own ``data_type``.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from shardkit.modules.embedding_configs import BaseEmbeddingConfig, DataType

STORAGE_OF: Dict[DataType, str] = {
    DataType.FP32: "fp32",
    DataType.FP16: "fp16",
    DataType.BF16: "bf16",
    DataType.INT8: "int8",
    DataType.INT4: "int4",
    DataType.INT2: "int2",
}

_FROM_TORCH_DTYPE = {
    torch.float32: DataType.FP32,
    torch.float16: DataType.FP16,
    torch.bfloat16: DataType.BF16,
    torch.qint8: DataType.INT8,
    torch.quint8: DataType.INT8,
    torch.int8: DataType.INT8,
    torch.uint8: DataType.INT8,
    torch.quint4x2: DataType.INT4,
    torch.quint2x4: DataType.INT2,
}


class QuantConfig(NamedTuple):
    """torchrec.quant's ``QuantConfig``: what a float module's ``qconfig`` tells ``from_float``.

    ``weight()`` / ``activation()`` return objects with a ``dtype`` (e.g. torch's
    ``PlaceholderObserver.with_args(dtype=torch.quint4x2)``): the tables' storage and the output dtype;
    ``per_table_weight_dtype`` overrides the weight dtype per table name.
    """

    activation: Callable[[], object]
    weight: Callable[[], object]
    per_table_weight_dtype: Optional[Dict[str, torch.dtype]] = None


def storage_of(data_type: Union[DataType, str]) -> str:
    """The row storage (``shardkit.kernels.quant_rows``) of a table of ``data_type``."""
    return STORAGE_OF[DataType(data_type)]


def dtype_to_data_type(dtype: torch.dtype) -> DataType:
    """The DataType of a ``qconfig`` weight dtype (``torch.qint8`` -> INT8, ``torch.quint4x2`` -> INT4,
    ``torch.quint2x4`` -> INT2, float dtypes -> FP32 / FP16 / BF16)."""
    if dtype not in _FROM_TORCH_DTYPE:
        raise ValueError(
            f"no quantized table storage for dtype {dtype}; expected one of {list(_FROM_TORCH_DTYPE)}"
        )
    return _FROM_TORCH_DTYPE[dtype]


def quantized_data_types(
    module: nn.Module, tables: Sequence[BaseEmbeddingConfig], data_type: Optional[DataType] = None
) -> Dict[str, DataType]:
    """Table name -> the data type ``from_float`` stores it in: ``data_type`` for every table when given,
    else the module's ``qconfig`` (torchrec's rule), else each config's own ``data_type``."""
    if data_type is not None:
        return {t.name: DataType(data_type) for t in tables}
    qconfig = getattr(module, "qconfig", None)
    if qconfig is None:
        return {t.name: t.data_type for t in tables}
    per_table = getattr(qconfig, "per_table_weight_dtype", None) or {}
    default = dtype_to_data_type(qconfig.weight().dtype)
    return {t.name: dtype_to_data_type(per_table[t.name]) if t.name in per_table else default for t in tables}


def qconfig_output_dtype(module: nn.Module) -> Optional[torch.dtype]:
    """The output dtype a float module's ``qconfig`` asks for (its activation observer's), or None."""
    qconfig = getattr(module, "qconfig", None)
    return None if qconfig is None else qconfig.activation().dtype


__all__ = [
    "QuantConfig",
    "STORAGE_OF",
    "dtype_to_data_type",
    "qconfig_output_dtype",
    "quantized_data_types",
    "storage_of",
]
