"""A trained model's embedding collections swapped for quantized ones (torchrec.inference.modules'
``quantize_embeddings`` and ``quantize_inference_model``).

Both walk the model and replace each collection of a listed type by ``mapping[type].from_float(module)``
after giving it a :class:`~shardkit.quant.QuantConfig` as its ``qconfig``: the tables' storage comes
from the weight dtype (``torch.float16`` / ``torch.bfloat16`` -> FP16 / BF16 rows, ``torch.int8`` /
``torch.qint8`` / ``torch.quint8`` -> INT8, ``torch.quint4x2`` -> INT4, ``torch.quint2x4`` -> INT2),
``per_table_weight_dtype`` overriding it per table name, and the output dtype from the activation
dtype (:func:`shardkit.quant.data_types.quantized_data_types`). The float modules are not modified;
dense layers stay as they are.

A managed-collision module (``ManagedCollisionEmbeddingCollection`` / ``...BagCollection``) whose
embedding module is of a type to quantize becomes torchrec's ``QuantManagedCollisionEmbeddingCollection``
/ ``...BagCollection`` (``shardkit.quant.mc_modules``): the embedding module quantized with that type's
dtypes (per-table dtypes included), the MC collection and its id -> slot maps copied, held in eval mode.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Type

import torch
import torch.ao.quantization as torch_quant
from torch import nn

from shardkit.modules import (
    EmbeddingBagCollection,
    FeatureProcessedEmbeddingBagCollection,
)
from shardkit.modules.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from shardkit.quant import (
    QuantConfig,
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
    QuantManagedCollisionEmbeddingBagCollection,
    QuantManagedCollisionEmbeddingCollection,
    dtype_to_data_type,
)

# torchrec's DEFAULT_QUANTIZATION_MAPPING: float module type name -> quantized module type
DEFAULT_QUANTIZATION_MAPPING: Dict[str, Type[nn.Module]] = {
    "EmbeddingBagCollection": QuantEmbeddingBagCollection,
    "EmbeddingCollection": QuantEmbeddingCollection,
}
DEFAULT_QUANTIZATION_DTYPE = torch.int8


def quant_config(
    dtype: torch.dtype,
    output_dtype: torch.dtype = torch.float,
    per_table_weight_dtype: Optional[Dict[str, torch.dtype]] = None,
) -> QuantConfig:
    """The ``qconfig`` torchrec builds: placeholder observers carrying the weight and output dtypes.

    ``ValueError`` naming the dtype (and the table) when a dtype has no table storage."""
    dtype_to_data_type(dtype)
    for table, table_dtype in (per_table_weight_dtype or {}).items():
        try:
            dtype_to_data_type(table_dtype)
        except ValueError as err:
            raise ValueError(f"per_table_weight_dtype[{table!r}]: {err}") from None
    return QuantConfig(
        activation=torch_quant.PlaceholderObserver.with_args(dtype=output_dtype),
        weight=torch_quant.PlaceholderObserver.with_args(dtype=dtype),
        per_table_weight_dtype=dict(per_table_weight_dtype) if per_table_weight_dtype else None,
    )


def _table_names(module: nn.Module) -> List[str]:
    for method in ("embedding_bag_configs", "embedding_configs"):
        if hasattr(module, method):
            return [t.name for t in getattr(module, method)()]
    inner = getattr(module, "embedding_bag_collection", None)
    return [] if inner is None else _table_names(inner)


# the quantized MC type of each float MC type (torchrec's QuantManagedCollision*): the embedding module
# inside is quantized by the qconfig of its own type, the MC collection (its id -> slot maps) is copied
_MC_QUANT_TYPES: Dict[Type[nn.Module], Type[nn.Module]] = {
    ManagedCollisionEmbeddingCollection: QuantManagedCollisionEmbeddingCollection,
    ManagedCollisionEmbeddingBagCollection: QuantManagedCollisionEmbeddingBagCollection,
}


def _swap_managed_collision(module: nn.Module, embedding: nn.Module, qconfig: QuantConfig) -> nn.Module:
    """``QuantManagedCollision*.from_float(module)`` with ``qconfig`` (the embedding module's type's)
    deciding the storages; the caller's float modules are left as they were."""
    quant_type = _MC_QUANT_TYPES.get(type(module))
    if quant_type is None:
        raise ValueError(
            f"{type(module).__name__}: no quantized managed-collision type for it (known: "
            f"{sorted(t.__name__ for t in _MC_QUANT_TYPES)})"
        )
    had, before = hasattr(embedding, "qconfig"), getattr(embedding, "qconfig", None)
    embedding.qconfig = qconfig
    try:
        return quant_type.from_float(module)
    finally:
        if had:
            embedding.qconfig = before
        else:
            del embedding.qconfig


def _swap(
    model: nn.Module,
    qconfigs: Dict[Type[nn.Module], QuantConfig],
    mapping: Dict[Type[nn.Module], Type[nn.Module]],
) -> nn.Module:
    """``model`` with every submodule whose exact type is in ``qconfigs`` replaced (in place) by
    ``mapping[type].from_float`` of it; the root itself may be replaced (returned)."""

    def visit(module: nn.Module, path: str) -> nn.Module:
        if type(module) in qconfigs:
            if type(module) not in mapping:
                raise ValueError(
                    f"{path or 'the model'} ({type(module).__name__}): no quantized type in the mapping"
                )
            had, before = hasattr(module, "qconfig"), getattr(module, "qconfig", None)
            module.qconfig = qconfigs[type(module)]
            try:
                return mapping[type(module)].from_float(module)
            finally:  # the caller's float module stays as it was
                if had:
                    module.qconfig = before
                else:
                    del module.qconfig
        if isinstance(module, BaseManagedCollisionEmbeddingCollection):
            embedding = module._embedding_module
            if type(embedding) in qconfigs:
                return _swap_managed_collision(module, embedding, qconfigs[type(embedding)])
        for name, child in list(module.named_children()):
            swapped = visit(child, f"{path}.{name}" if path else name)
            if swapped is not child:
                setattr(module, name, swapped)
        return module

    return visit(model, "")


def quantize_embeddings(
    module: nn.Module,
    dtype: torch.dtype,
    inplace: bool,
    additional_qconfig_spec_keys: Optional[List[Type[nn.Module]]] = None,
    additional_mapping: Optional[Dict[Type[nn.Module], Type[nn.Module]]] = None,
    output_dtype: torch.dtype = torch.float,
    per_table_weight_dtype: Optional[Dict[str, torch.dtype]] = None,
) -> nn.Module:
    """``module`` with its ``EmbeddingBagCollection`` s (and the types of ``additional_qconfig_spec_keys``)
    quantized: each becomes ``QuantEmbeddingBagCollection.from_float`` of it (or ``additional_mapping``'s
    type for it).

    Args:
        module: the trained float model (or a collection itself, which is then replaced).
        dtype: every table's weight dtype (see the module docstring).
        inplace: modify ``module`` (True) or quantize a deep copy (False).
        additional_qconfig_spec_keys: more module types to quantize (exact types, as torch's
            ``quantize_dynamic``), e.g. ``[EmbeddingCollection]``.
        additional_mapping: float type -> quantized type, added to / overriding
            ``{EmbeddingBagCollection: QuantEmbeddingBagCollection}``.
        output_dtype: the quantized collections' output dtype.
        per_table_weight_dtype: table name -> weight dtype, overriding ``dtype`` for that table; a
            name no quantized collection has is a ``ValueError`` (never ignored).

    Returns the quantized model. ``ValueError`` for a dtype without a table storage or a table name that is
    not in any quantized collection. A managed-collision module whose embedding module is of a type to
    quantize becomes its ``QuantManagedCollision*`` counterpart (module docstring).
    """
    qconfig = quant_config(dtype, output_dtype, per_table_weight_dtype)
    qconfigs: Dict[Type[nn.Module], QuantConfig] = {EmbeddingBagCollection: qconfig}
    mapping: Dict[Type[nn.Module], Type[nn.Module]] = {EmbeddingBagCollection: QuantEmbeddingBagCollection}
    for key in additional_qconfig_spec_keys or []:
        qconfigs[key] = qconfig
    mapping.update(additional_mapping or {})
    tables = [t for m in module.modules() if type(m) in qconfigs for t in _table_names(m)]
    unknown = sorted(set(per_table_weight_dtype or {}) - set(tables))
    if unknown:
        raise ValueError(
            f"per_table_weight_dtype names tables {unknown} that no collection to quantize has "
            f"(its tables: {sorted(tables)})"
        )
    if not inplace:
        module = copy.deepcopy(module)
    return _swap(module, qconfigs, mapping)


def quantize_inference_model(
    model: nn.Module,
    quantization_mapping: Optional[Dict[str, Type[nn.Module]]] = None,
    per_table_weight_dtype: Optional[Dict[str, torch.dtype]] = None,
    fp_weight_dtype: torch.dtype = DEFAULT_QUANTIZATION_DTYPE,
    quantization_dtype: torch.dtype = DEFAULT_QUANTIZATION_DTYPE,
    output_dtype: torch.dtype = torch.float,
) -> nn.Module:
    """``model`` (modified in place and returned, as torchrec) with its embedding collections quantized.

    Args:
        model: the trained float model.
        quantization_mapping: float module *type name* -> quantized type; default
            :data:`DEFAULT_QUANTIZATION_MAPPING` (``EmbeddingBagCollection`` and ``EmbeddingCollection``).
        per_table_weight_dtype: table name -> weight dtype (overrides the others for that table).
        fp_weight_dtype: the weight dtype of the tables of ``FeatureProcessedEmbeddingBagCollection`` s
            (quantized into ``QuantFeatureProcessedEmbeddingBagCollection``, processors copied).
        quantization_dtype: every other table's weight dtype.
        output_dtype: the collections' output dtype.

    ``ValueError`` as :func:`quantize_embeddings`; managed-collision modules as there.
    """
    mapping_by_name = DEFAULT_QUANTIZATION_MAPPING if quantization_mapping is None else quantization_mapping
    keys: List[Type[nn.Module]] = []
    mapping: Dict[Type[nn.Module], Type[nn.Module]] = {}
    fp_types: List[Type[nn.Module]] = []
    for module in model.modules():
        kind = type(module)
        if kind.__name__ in mapping_by_name and kind not in mapping:
            keys.append(kind)
            mapping[kind] = mapping_by_name[kind.__name__]
        elif kind is FeatureProcessedEmbeddingBagCollection and kind not in fp_types:
            fp_types.append(kind)
    per_table = dict(per_table_weight_dtype or {})
    if fp_types:
        # feature-processed collections first, with their own weight dtype (torchrec's fp_weight_dtype)
        fp_tables = {
            t
            for m in model.modules()
            if type(m) in fp_types
            for t in _table_names(m.embedding_bag_collection)
        }
        fp_qconfig = quant_config(
            fp_weight_dtype, output_dtype, {t: d for t, d in per_table.items() if t in fp_tables} or None
        )
        fp_mapping = {FeatureProcessedEmbeddingBagCollection: QuantFeatureProcessedEmbeddingBagCollection}
        model = _swap(model, {FeatureProcessedEmbeddingBagCollection: fp_qconfig}, fp_mapping)
        per_table = {t: d for t, d in per_table.items() if t not in fp_tables}
    return quantize_embeddings(
        model,
        dtype=quantization_dtype,
        inplace=True,
        additional_qconfig_spec_keys=keys,
        additional_mapping=mapping,
        output_dtype=output_dtype,
        per_table_weight_dtype=per_table or None,
    )


__all__ = [
    "DEFAULT_QUANTIZATION_DTYPE",
    "DEFAULT_QUANTIZATION_MAPPING",
    "quant_config",
    "quantize_embeddings",
    "quantize_inference_model",
]
