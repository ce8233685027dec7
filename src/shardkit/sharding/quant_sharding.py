"""Inference shardings of quantized tables: table-wise, row-wise and column-wise, pooled and sequence.

Each is the float sharding of its type (same input dist, same output dist, same column layout) whose
lookup holds this rank's shards as quantized rows (:class:`QuantShardedGroupedLookup`) and outputs
fp32. A shard's rows are cut out of the unsharded module's stored rows without re-quantization: a
row block keeps its rows as they are, a column block keeps the codes of its columns together with the
row's own scale and bias (``shardkit.kernels.quant_rows.slice_columns``). So every shard dequantizes
to exactly the values of the unsharded quantized table, and the sharded output equals the unsharded
one to the reassociation of fp32 sums (row-wise: partial sums added by the reduce-scatter).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Type

import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.kernels.quant_rows import slice_columns
from shardkit.quant.offloaded_quant_lookup import OffloadedQuantEmbeddingLookup
from shardkit.quant.quant_lookup import QuantGroupedEmbeddingLookup
from shardkit.sharding.column_wise import CwPooledEmbeddingSharding, CwSequenceEmbeddingSharding
from shardkit.sharding.embedding_lookup import ShardedGroupedLookup
from shardkit.sharding.embedding_sharding import EmbeddingShardingImpl, ShardedTable
from shardkit.sharding.row_wise import RwPooledEmbeddingSharding, RwSequenceEmbeddingSharding
from shardkit.sharding.table_wise import TwPooledEmbeddingSharding, TwSequenceEmbeddingSharding
from shardkit.sharding.types import ShardingType


class QuantShardedGroupedLookup(ShardedGroupedLookup):
    """This rank's quantized shards, one :class:`QuantGroupedEmbeddingLookup` per (width, data type)."""

    group_lookup_class = QuantGroupedEmbeddingLookup
    groups_function = None  # a quantized group's kernel is its own: each group alone
    offloaded_lookup_class = OffloadedQuantEmbeddingLookup

    @torch.no_grad()
    def load_tables(self, table_weight) -> None:
        """Copy each shard out of ``table_weight(name)``, the unsharded table's stored rows
        ``[rows, row_bytes]`` (a column block: its columns' codes and each row's scale and bias)."""
        for lookup, group in zip(self.lookups, self.placed):
            for i, (table, shard) in enumerate(group):
                rows = table_weight(table.name)[shard.row_start : shard.row_end]
                dim = table.config.embedding_dim
                lookup.shard_rows(i).copy_(
                    slice_columns(rows, dim, lookup.storage, shard.col_start, shard.col_end)
                )


class InferTwEmbeddingSharding(TwPooledEmbeddingSharding):
    """Table-wise pooled lookups of quantized tables (torchrec's ``InferTwEmbeddingSharding``)."""

    @property
    def output_dtype(self) -> torch.dtype:
        return torch.float32  # the lookups dequantize to fp32; the module converts at the end

    def create_lookup(self) -> QuantShardedGroupedLookup:
        return QuantShardedGroupedLookup(
            self._local_shards, True, self.weighted, self.device, dtype=self.output_dtype
        )


class InferCwPooledEmbeddingSharding(InferTwEmbeddingSharding, CwPooledEmbeddingSharding):
    """Column-wise pooled lookups of quantized tables (the table-wise dists over column blocks)."""


class InferRwPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """Row-wise pooled lookups of quantized tables (partial sums of row blocks, reduce-scattered)."""

    @property
    def output_dtype(self) -> torch.dtype:
        return torch.float32

    def create_lookup(self) -> QuantShardedGroupedLookup:
        return QuantShardedGroupedLookup(
            self._sum_pooled_shards(), True, self.weighted, self.device, dtype=self.output_dtype
        )


class InferTwSequenceEmbeddingSharding(TwSequenceEmbeddingSharding):
    """Table-wise sequence lookups of quantized tables (torchrec's ``InferTwSequenceEmbeddingSharding``):
    each id's dequantized row, padded to the sharding's widest shard."""

    @property
    def output_dtype(self) -> torch.dtype:
        return torch.float32

    def create_lookup(self) -> QuantShardedGroupedLookup:
        return QuantShardedGroupedLookup(
            self._local_shards, False, False, self.device, None, self._width, self.output_dtype
        )


class InferCwSequenceEmbeddingSharding(InferTwSequenceEmbeddingSharding, CwSequenceEmbeddingSharding):
    """Column-wise sequence lookups of quantized tables (the table-wise dists over column blocks)."""


class InferRwSequenceEmbeddingSharding(RwSequenceEmbeddingSharding):
    """Row-wise sequence lookups of quantized tables (each id sent to the rank holding its row)."""

    @property
    def output_dtype(self) -> torch.dtype:
        return torch.float32

    def create_lookup(self) -> QuantShardedGroupedLookup:
        return QuantShardedGroupedLookup(
            self._local_shards, False, False, self.device, None, self._width, self.output_dtype
        )


INFER_SEQUENCE_SHARDINGS: Dict[str, Type[EmbeddingShardingImpl]] = {
    ShardingType.TABLE_WISE.value: InferTwSequenceEmbeddingSharding,
    ShardingType.ROW_WISE.value: InferRwSequenceEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: InferCwSequenceEmbeddingSharding,
}

INFER_POOLED_SHARDINGS: Dict[str, Type[EmbeddingShardingImpl]] = {
    ShardingType.TABLE_WISE.value: InferTwEmbeddingSharding,
    ShardingType.ROW_WISE.value: InferRwPooledEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: InferCwPooledEmbeddingSharding,
}


def create_infer_embedding_bag_sharding(
    sharding_type: str,
    sharding_infos: List[ShardedTable],
    env: ShardingEnv,
    device: Optional[torch.device] = None,
    weighted: bool = False,
) -> EmbeddingShardingImpl:
    """The inference sharding of quantized pooled tables of ``sharding_type`` (``table_wise``,
    ``row_wise`` or ``column_wise``) for ``sharding_infos`` (the placed tables, all of that type;
    ``shardkit.sharding.embedding_sharding.sharded_table``), pooling with per-id weights if ``weighted``.

    ``ValueError`` for another sharding type.
    """
    if sharding_type not in INFER_POOLED_SHARDINGS:
        raise ValueError(
            f"no inference sharding of type {sharding_type!r} for quantized tables; "
            f"supported: {list(INFER_POOLED_SHARDINGS)}"
        )
    return INFER_POOLED_SHARDINGS[sharding_type](sharding_infos, env, True, None, device, None, weighted)


__all__ = [
    "INFER_POOLED_SHARDINGS",
    "INFER_SEQUENCE_SHARDINGS",
    "InferCwPooledEmbeddingSharding",
    "InferCwSequenceEmbeddingSharding",
    "InferRwSequenceEmbeddingSharding",
    "InferTwSequenceEmbeddingSharding",
    "InferRwPooledEmbeddingSharding",
    "InferTwEmbeddingSharding",
    "QuantShardedGroupedLookup",
    "create_infer_embedding_bag_sharding",
]
