"""Row pruning of a quantized model's tables (torchrec's pruning-indices remapping on the inference path).

``prune_inference_model(model, keep_rows=..., row_norm_threshold=...)`` replaces every
``QuantEmbeddingBagCollection`` / ``QuantEmbeddingCollection`` of a quantized model (after
:func:`~shardkit.inference.quantize_inference_model`) by ``shardkit.quant.prune_rows`` of it
(:class:`~shardkit.quant.pruning.PrunedQuantEmbeddings`: same outputs for kept ids, zeros for dropped
ones, ids in the original ranges) and returns the model with one :class:`~shardkit.quant.PruningReport`
of all its tables.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from shardkit.quant import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from shardkit.quant.pruning import PruningReport, prune_rows


def _tables(module: nn.Module):
    configs = (
        module.embedding_bag_configs()
        if isinstance(module, QuantEmbeddingBagCollection)
        else module.embedding_configs()
    )
    return [c.name for c in configs]


def prune_inference_model(
    model: nn.Module,
    keep_rows: Optional[Mapping[str, Union[torch.Tensor, Sequence[int]]]] = None,
    row_norm_threshold: Optional[Union[float, Mapping[str, float]]] = None,
) -> Tuple[nn.Module, PruningReport]:
    """``model`` (modified in place; a collection itself is replaced and returned) with its quantized
    collections pruned, and the report of every table.

    ``keep_rows`` / ``row_norm_threshold`` as :func:`shardkit.quant.prune_rows`, over all the model's
    quantized tables: a table name no quantized collection has is a ``ValueError``; a collection none of
    whose tables is named is left as it is."""
    found = []

    def visit(module: nn.Module) -> nn.Module:
        if type(module) in (QuantEmbeddingBagCollection, QuantEmbeddingCollection):
            names = _tables(module)
            found.extend(names)
            if keep_rows is not None:
                mine = {t: ids for t, ids in keep_rows.items() if t in names}
                return prune_rows(module, keep_rows=mine) if mine else module
            if isinstance(row_norm_threshold, Mapping):
                mine = {t: v for t, v in row_norm_threshold.items() if t in names}
                return prune_rows(module, row_norm_threshold=mine) if mine else module
            return prune_rows(module, row_norm_threshold=row_norm_threshold)
        for name, child in list(module.named_children()):
            swapped = visit(child)
            if swapped is not child:
                setattr(module, name, swapped)
        return module

    if (keep_rows is None) == (row_norm_threshold is None):
        raise ValueError("prune_inference_model needs exactly one of keep_rows and row_norm_threshold")
    model = visit(model)
    named = keep_rows if keep_rows is not None else row_norm_threshold
    unknown = sorted(set(named) - set(found)) if isinstance(named, Mapping) else []
    if unknown:
        raise ValueError(
            f"names tables {unknown} that no quantized collection of the model has ({sorted(found)})"
        )
    reports = [
        t
        for m in model.modules()
        if hasattr(m, "report") and isinstance(m.report, PruningReport)
        for t in m.report.tables
    ]
    return model, PruningReport(reports)


__all__ = ["prune_inference_model"]
