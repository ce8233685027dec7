"""Row pruning of quantized tables with index remapping (torchrec / fbgemm's ``pruning_indices_remapping``).

``prune_rows(module, keep_rows=..., row_norm_threshold=...)`` drops rows of a quantized collection's
tables (a list of kept row ids per table, or every row whose dequantized L2 norm is at most a threshold)
and returns a :class:`PrunedQuantEmbeddings`: a smaller quantized collection of the same type (each pruned
table holds its kept rows, byte for byte the unpruned rows, in id order, then one all-zero row) behind an
int32 remapping per pruned table, ``[num_embeddings]`` (torchrec's ``pruning_indices_remapping``: the
original id -> its row in the pruned table, the zero row for a dropped id). Ids keep their original
range: a kept id looks up exactly the unpruned quantized row, a dropped id looks up zeros (its bag
contributes nothing to a sum; a mean still counts it, as a zero row).

The all-zero row decodes to zeros for every storage (int rows: codes, scale and bias zero; fp16 / bf16:
+0.0), so the pruned collection is an ordinary quantized collection: shard ``pruned.embeddings`` with the
quantized sharders (table-, row-, column-wise) and the remapping, a per-id gather, runs on each rank's
requests before the sharded lookup. :class:`PruningReport` gives each table's rows and bytes before and
after (remapping included).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from shardkit.kernels.quant_rows import dequantize_rows
from shardkit.quant.embedding_modules import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from shardkit.sparse import KeyedJaggedTensor

QuantCollection = Union[QuantEmbeddingBagCollection, QuantEmbeddingCollection]


@dataclasses.dataclass(frozen=True)
class TablePruning:
    """One table: ``rows`` before, ``kept`` rows, stored bytes before / after (after: the kept rows, the
    zero row and the int32 remapping)."""

    name: str
    rows: int
    kept: int
    bytes_before: int
    bytes_after: int


@dataclasses.dataclass(frozen=True)
class PruningReport:
    tables: List[TablePruning]

    @property
    def bytes_before(self) -> int:
        return sum(t.bytes_before for t in self.tables)

    @property
    def bytes_after(self) -> int:
        return sum(t.bytes_after for t in self.tables)

    @property
    def bytes_saved(self) -> int:
        """Stored bytes saved (negative when a remapping costs more than the rows it dropped)."""
        return self.bytes_before - self.bytes_after

    def __str__(self) -> str:
        lines = [
            f"{t.name}: {t.kept}/{t.rows} rows kept, {t.bytes_before} -> {t.bytes_after} bytes"
            for t in self.tables
        ]
        lines.append(
            f"total: {self.bytes_before} -> {self.bytes_after} bytes ({self.bytes_saved} saved, "
            f"{self.bytes_after / max(self.bytes_before, 1):.2f}x)"
        )
        return "\n".join(lines)


def _configs(module: QuantCollection):
    if isinstance(module, QuantEmbeddingBagCollection):
        return module.embedding_bag_configs()
    return module.embedding_configs()


def _kept_ids(
    module: QuantCollection,
    keep_rows: Optional[Mapping[str, Union[torch.Tensor, Sequence[int]]]],
    row_norm_threshold: Optional[Union[float, Mapping[str, float]]],
) -> Dict[str, torch.Tensor]:
    """Table name -> sorted unique kept row ids (int64), for each table to prune."""
    configs = {t.name: t for t in _configs(module)}
    if (keep_rows is None) == (row_norm_threshold is None):
        raise ValueError("prune_rows needs exactly one of keep_rows and row_norm_threshold")
    out: Dict[str, torch.Tensor] = {}
    if keep_rows is not None:
        unknown = sorted(set(keep_rows) - set(configs))
        if unknown:
            raise ValueError(f"keep_rows names tables {unknown} the module does not have ({sorted(configs)})")
        for name, ids in keep_rows.items():
            ids = torch.as_tensor(ids)
            if ids.is_floating_point() or ids.dim() != 1:
                raise ValueError(
                    f"keep_rows[{name!r}]: a 1-d tensor of integer row ids, "
                    f"got {ids.dtype} {tuple(ids.shape)}"
                )
            rows = configs[name].num_embeddings
            bad = ids[(ids < 0) | (ids >= rows)]
            if bad.numel():
                raise ValueError(f"keep_rows[{name!r}]: ids {bad[:5].tolist()} outside [0, {rows})")
            out[name] = torch.unique(ids.to(torch.int64).cpu())
        return out
    thresholds = (
        dict(row_norm_threshold)
        if isinstance(row_norm_threshold, Mapping)
        else {name: float(row_norm_threshold) for name in configs}
    )
    unknown = sorted(set(thresholds) - set(configs))
    if unknown:
        raise ValueError(
            f"row_norm_threshold names tables {unknown} the module does not have ({sorted(configs)})"
        )
    for name, threshold in thresholds.items():
        rows = dequantize_rows(
            module.table_weight(name), configs[name].embedding_dim, module.table_storage(name)
        )
        out[name] = torch.nonzero(rows.float().norm(dim=1) > threshold).flatten().cpu()
    return out


class PrunedQuantEmbeddings(nn.Module):
    """A quantized collection with pruned tables behind their id remappings.

    Attributes:
        embeddings: the pruned quantized collection (same type as the unpruned one; pruned tables have
            ``kept + 1`` rows, the last all zeros). Shard it with the quantized sharders.
        report: the :class:`PruningReport` of the pruning that made it.

    Buffers ``pruning_indices_remapping_<table>``: int32 ``[num_embeddings]`` of the unpruned table.

    forward(features: KeyedJaggedTensor with the unpruned tables' id ranges) -> what ``embeddings``
    returns (``KeyedTensor`` or ``{feature: JaggedTensor}``). An id outside its unpruned table is a
    ``ValueError`` naming the feature.
    """

    def __init__(
        self,
        embeddings: nn.Module,
        remappings: Mapping[str, torch.Tensor],
        feature_tables: Mapping[str, str],
        report: PruningReport,
    ) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.report = report
        self._feature_tables = dict(feature_tables)
        self._pruned = sorted(remappings)
        for name, remap in remappings.items():
            self.register_buffer(f"pruning_indices_remapping_{name}", remap)

    def embedding_bag_configs(self):
        """The unpruned tables' configs (the id ranges requests use); bag collections only."""
        return self._unpruned_configs("embedding_bag_configs")

    def embedding_configs(self):
        """The unpruned tables' configs (the id ranges requests use); sequence collections only."""
        return self._unpruned_configs("embedding_configs")

    def _unpruned_configs(self, method: str):
        if not hasattr(self.embeddings, method):
            raise AttributeError(f"{type(self.embeddings).__name__} has no {method}")
        rows = {t.name: t.rows for t in self.report.tables}
        return [
            dataclasses.replace(c, num_embeddings=rows[c.name]) for c in getattr(self.embeddings, method)()
        ]

    def remapping(self, table: str) -> torch.Tensor:
        """int32 ``[num_embeddings]``: unpruned id -> row of the pruned table (``KeyError`` if not pruned)."""
        if table not in self._pruned:
            raise KeyError(f"table {table!r} is not pruned (pruned: {self._pruned})")
        return getattr(self, f"pruning_indices_remapping_{table}")

    def remap(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` with the ids of pruned tables' features replaced by their pruned rows."""
        values = features.values()
        pieces = []
        start = 0
        for key, length in zip(features.keys(), features.length_per_key()):
            ids = values[start : start + length]
            start += length
            table = self._feature_tables.get(key)
            if table not in self._pruned:
                pieces.append(ids)
                continue
            remap = self.remapping(table)
            if ids.is_floating_point():
                raise ValueError(f"feature {key!r}: ids must be integers, got {ids.dtype}")
            bad = ids[(ids < 0) | (ids >= remap.numel())]
            if bad.numel():
                raise ValueError(
                    f"feature {key!r}: ids {bad[:5].tolist()} outside [0, {remap.numel()}) (table {table!r})"
                )
            pieces.append(remap[ids].to(ids.dtype))
        remapped = torch.cat(pieces) if pieces else values
        return KeyedJaggedTensor(
            features.keys(), remapped, weights=features.weights_or_none(), lengths=features.lengths()
        )

    def forward(self, features: KeyedJaggedTensor):
        return self.embeddings(self.remap(features))


@torch.no_grad()
def prune_rows(
    module: QuantCollection,
    keep_rows: Optional[Mapping[str, Union[torch.Tensor, Sequence[int]]]] = None,
    row_norm_threshold: Optional[Union[float, Mapping[str, float]]] = None,
) -> PrunedQuantEmbeddings:
    """``module`` (a quantized collection, not modified) with rows dropped and ids remapped.

    Args:
        module: a ``QuantEmbeddingBagCollection`` or ``QuantEmbeddingCollection``.
        keep_rows: table name -> the row ids to keep (int tensor or list; order and repeats do not
            matter); tables not named are kept whole.
        row_norm_threshold: drop the rows whose dequantized L2 norm is <= this (a float for every table,
            or table name -> threshold for some).

    Exactly one of the two. ``ValueError`` naming the table for an unknown table or an id out of range.
    """
    if type(module) not in (QuantEmbeddingBagCollection, QuantEmbeddingCollection):
        raise TypeError(
            "prune_rows takes a QuantEmbeddingBagCollection or QuantEmbeddingCollection, "
            f"got {type(module).__name__}"
        )
    kept = _kept_ids(module, keep_rows, row_norm_threshold)
    configs = list(_configs(module))
    new_configs = [
        dataclasses.replace(t, num_embeddings=int(kept[t.name].numel()) + 1) if t.name in kept else t
        for t in configs
    ]
    if isinstance(module, QuantEmbeddingBagCollection):
        extra = {"is_weighted": module.is_weighted()}
    else:
        extra = {"need_indices": module.need_indices()}
    device = module.table_weight(configs[0].name).device
    pruned = type(module)(new_configs, device=torch.device("meta"), output_dtype=module.output_dtype, **extra)
    pruned.to_empty(device=device)
    remappings: Dict[str, torch.Tensor] = {}
    tables: List[TablePruning] = []
    for config in configs:
        source, target = module.table_weight(config.name), pruned.table_weight(config.name)
        before = source.numel() * source.element_size()
        if config.name not in kept:
            target.copy_(source)
            tables.append(
                TablePruning(config.name, config.num_embeddings, config.num_embeddings, before, before)
            )
            continue
        ids = kept[config.name].to(device)
        target[: ids.numel()] = source[ids]
        target[ids.numel() :] = 0  # the zero row every dropped id looks up
        remap = torch.full((config.num_embeddings,), ids.numel(), dtype=torch.int32, device=device)
        remap[ids] = torch.arange(ids.numel(), dtype=torch.int32, device=device)
        remappings[config.name] = remap
        after = target.numel() * target.element_size() + remap.numel() * remap.element_size()
        tables.append(TablePruning(config.name, config.num_embeddings, int(ids.numel()), before, after))
    feature_tables = {f: t.name for t in configs for f in t.feature_names}
    return PrunedQuantEmbeddings(pruned, remappings, feature_tables, PruningReport(tables))


__all__ = ["PrunedQuantEmbeddings", "PruningReport", "TablePruning", "prune_rows"]
