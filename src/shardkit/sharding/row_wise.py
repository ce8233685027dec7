"""Row-wise sharding: each table's rows are cut into blocks, block ``r`` on rank ``r`` (uneven and
empty blocks allowed: the plan's shard sizes are the blocks).

- input dist: *block bucketization*: every id goes to the rank whose block holds its row; bag ``b``
  of feature ``f`` becomes one (possibly empty) bag per rank, holding that rank's ids of the bag in
  their original order. One stable sort of the ids by (destination key, bag), then one ``KJTAllToAll``.
- lookup: ``ShardedGroupedLookup`` of the rank's block of each table (ids stay table ids; the grouped
  lookup shifts them into its buffer), over every rank's samples.
- output dist: pooled, each rank holds partial sums of every sample, so ``PooledEmbeddingsReduceScatter``
  sums them and gives each rank its samples (a MEAN table is looked up as a SUM, and the summed bag is
  divided by its full length on the rank that owns the sample: the mean of per-block means is not
  the bag's mean); sequence, ``SequenceEmbeddingsAllToAll`` returns each id's
  row and the inverse of the bucketization sort puts the rows back in input order.

Table-row-wise sharding (blocks over one node's ranks) and grid sharding (its column blocks) reuse
:class:`RowBucketRouting`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from shardkit.distributed.awaitable import Awaitable
from shardkit.kernels import bucketize_blocks
from shardkit.kernels.bucketize import BlockTensors
from shardkit.modules.embedding_configs import PoolingType
from shardkit.sharding.dist_data import (
    PooledEmbeddingsReduceScatter,
    VariableBatchPooledEmbeddingsReduceScatter,
)
from shardkit.sharding.embedding_lookup import ShardedGroupedLookup, group_shards, received_keys
from shardkit.sharding.embedding_sharding import (
    ColumnBlock,
    EmbeddingShardingImpl,
    MappedAwaitable,
    ShardingContext,
    TableShard,
    record_input,
    start_kjt_all_to_all,
)
from shardkit.sharding.types import CommOp
from shardkit.sharding.variable_batch import (
    bags_per_rank_per_feature,
    expand_blocks,
    feature_major_to_rank_major,
)
from shardkit.sparse import KeyedJaggedTensor


class RowBucketRouting(EmbeddingShardingImpl):
    """Shardings whose shards are row blocks: each id goes to the one block holding its row.

    A table's blocks span all its columns, or (grid sharding) the columns of one column block.

    ``stagger`` is the KJT all-to-all's (table-row-wise interleaves the source ranks by node).
    """

    stagger = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        per_rank = [
            [(t, s) for t in self.tables for s in t.shards if s.rank == r and not s.empty]
            for r in range(self.world_size)
        ]
        self._per_rank = per_rank
        self._local_shards = per_rank[self.rank]
        # a table's features' positions in the input (by table, not by name: grid sharding gives each
        # column block of a table its own entry in ``tables``, so a feature name repeats in the input)
        first_feature, position = {}, 0
        for table in self.tables:
            first_feature[id(table)] = position
            position += len(table.config.feature_names)
        # one sent key per (rank, shard, feature of the shard's table), rank by rank
        sent: List[Tuple[int, int, int]] = []  # (input feature, first row of the block, rank)
        for r, shards in enumerate(per_rank):
            # the order of received_keys: groups, their shards, each shard's table's features
            for group in group_shards(shards):
                for table, shard in group:
                    first = first_feature[id(table)]
                    sent += [(first + j, shard.row_start, r) for j in range(len(table.config.feature_names))]
        self._sent_feature = [i for i, _, _ in sent]
        self._sent_names = [f"{self._feature_names[i]}@{r}" for i, _, r in sent]
        self._splits = [sum(1 for _, _, r in sent if r == rank) for rank in range(self.world_size)]
        # per input feature: its blocks' first rows (ascending) and the sent key of each block
        self._block_starts: List[List[int]] = []
        self._block_keys: List[List[int]] = []
        for i in range(len(self._feature_names)):
            blocks = sorted((row, k) for k, (j, row, _) in enumerate(sent) if j == i)
            self._block_starts.append([row for row, _ in blocks])
            self._block_keys.append([k for _, k in blocks])
        # the bucketize kernel's index tensors of these blocks, made once per device
        self._block_tensors = BlockTensors(self._block_starts, self._block_keys, self._sent_feature)
        self._dims = {f: t.config.embedding_dim for t in self.tables for f in t.config.feature_names}
        # every rank holds a non-empty block of every table (no rank pads missing features)
        names = {t.name for t in self.tables}
        self._blocks_everywhere = all({t.name for t, _ in shards} == names for shards in per_rank)
        self._pad_indices: Dict[tuple, Optional[torch.Tensor]] = {}  # see _pad_to
        # _full_keys of each list of tables asked for (by the ids of its tables), with the tables
        self._full_keys_of: Dict[tuple, Tuple[list, List[ColumnBlock]]] = {}
        self._reduce_scatters: Optional[tuple] = None  # (pg, codecs, the dist), see _reduce_scatter
        self._mean_features = [
            f
            for t in self.tables
            if getattr(t.config, "pooling", None) is PoolingType.MEAN
            for f in t.config.feature_names
        ]

    def received_features(self) -> List[str]:
        return [f for f, _, _ in received_keys(self._local_shards)]

    def _route(self, ctx: ShardingContext, features: KeyedJaggedTensor, need_recat: bool):
        record_input(ctx, features)
        send, order = self.bucketize(features, need_order=need_recat)
        if need_recat:
            ctx.unbucketize = torch.empty_like(order).index_copy_(
                0, order, torch.arange(order.numel(), device=order.device)
            )
        return start_kjt_all_to_all(
            ctx, self.pg, send, self._splits, self.stagger, need_recat, self.input_slots
        )

    def bucketize(
        self, features: KeyedJaggedTensor, need_order: bool = True
    ) -> Tuple[KeyedJaggedTensor, Optional[torch.Tensor]]:
        """The KJT to send (keys ``feature@rank``, rank by rank) and the sort ``order`` of the input ids
        (sent ids = ``values[order]``; None when not ``need_order`` and the input has no weights, which
        the order permutes). One host sync (the sent KJT's per-key totals, which its all-to-all reads)
        beyond the input's cached ``length_per_key``.
        """
        weights = features.weights_or_none()
        order, lengths, sent_values = bucketize_blocks(
            features.values(),
            features.offsets(),
            features.stride_per_key(),
            self._block_starts,
            self._block_keys,
            self._sent_feature,
            features.length_per_key(),
            need_order=need_order or weights is not None,
            fixed=self._block_tensors,
        )
        sent_weights = None if weights is None else weights.index_select(0, order)
        if not features.variable_stride_per_key():
            # the kernel's output, of the checked input's ids: no re-validation (~15 us). Its per-key
            # totals are its lengths' row sums (``[keys, B]``), read now in the host sync the KJT
            # all-to-all's send plan makes anyway (a cumsum, an index tensor and a gather otherwise)
            stride = features.stride()
            per_key = lengths.view(len(self._sent_names), stride).sum(1).tolist()
            return (
                KeyedJaggedTensor._trusted(
                    list(self._sent_names), sent_values, sent_weights, lengths, stride, per_key
                ),
                order,
            )
        spkpr = features.stride_per_key_per_rank()
        send = KeyedJaggedTensor(
            self._sent_names,
            sent_values,
            sent_weights,
            lengths=lengths,
            stride_per_key_per_rank=[spkpr[i] for i in self._sent_feature],
            validate=False,
        )
        return send, order

    def _sum_pooled_shards(self) -> list:
        """This rank's shards with MEAN tables looked up as SUM (the mean is taken after the reduce)."""
        return [
            (dataclasses.replace(t, config=dataclasses.replace(t.config, pooling=PoolingType.SUM)), s)
            if t.config.pooling is PoolingType.MEAN
            else (t, s)
            for t, s in self._local_shards
        ]

    def _record_mean_lengths(self, ctx: ShardingContext, features: KeyedJaggedTensor) -> None:
        if self._mean_features:
            ctx.mean_bag_lengths = {f: features[f].lengths() for f in self._mean_features}

    def _divide_means(self, pooled: torch.Tensor, ctx: ShardingContext) -> torch.Tensor:
        """``[B_me, widths]`` bag sums in :meth:`output_layout` order -> MEAN features' blocks divided
        by their bag lengths (an empty bag stays 0), as the unsharded lookup does."""
        lengths = ctx.mean_bag_lengths
        if not lengths:
            return pooled
        blocks, start = [], 0
        for feature, c0, c1 in self.output_layout():
            block = pooled[:, start : start + c1 - c0]
            start += c1 - c0
            if feature in lengths:
                scale = lengths[feature].clamp(min=1).to(torch.float32).reciprocal()
                block = block * scale.to(block.dtype).unsqueeze(1)
            blocks.append(block)
        return torch.cat(blocks, dim=1)

    def _full_keys(self, tables) -> List[ColumnBlock]:
        """Pooled column layout of ``tables``' features (what a rank holding every block would output):
        each table's columns are those of its shards (all of them, or one grid column block).

        Worked out once per list of tables (fixed by the plan, as the shards are): the output dist
        of every step asks, and at 64 tables the walk over them cost more than the rest of the
        output dist's Python. The cached entry holds the tables, so their ids stay theirs. Callers
        only read the returned list."""
        key = tuple(map(id, tables))
        cached = self._full_keys_of.get(key)
        if cached is None:
            whole = [(t, TableShard(-1, 0, t.config.num_embeddings, *_column_span(t))) for t in tables]
            cached = self._full_keys_of[key] = (list(tables), received_keys(whole))
        return cached[1]

    def _reduce_scatter(self, pg, codecs) -> PooledEmbeddingsReduceScatter:
        """The pooled reduce-scatter over ``pg`` with ``codecs``, built once (an nn.Module costs
        ~20-30 us to construct) and called by its ``forward`` (it is in no module tree: no hooks)."""
        cached = self._reduce_scatters
        if cached is None or cached[0] is not pg or cached[1] is not codecs:
            cached = self._reduce_scatters = (pg, codecs, PooledEmbeddingsReduceScatter(pg, codecs))
        return cached[2]

    def _pad_to(self, local_out: torch.Tensor, full_keys: List[ColumnBlock]) -> torch.Tensor:
        """Pooled ``[R, this rank's received widths]`` -> ``[R, full widths]``, zeros for blocks held
        elsewhere. The column index is built once per layout (the layouts are fixed by the plan)."""
        cache_key = (tuple(full_keys), local_out.device)
        if cache_key not in self._pad_indices:
            self._pad_indices[cache_key] = self._pad_index(full_keys, local_out.device)
        index = self._pad_indices[cache_key]
        if index is None:
            return local_out
        width = sum(c1 - c0 for _, c0, c1 in full_keys)
        full = local_out.new_zeros(local_out.size(0), width)
        if index.numel() == 0:
            # nothing held here, but the collective's backward needs this rank: keep local_out's graph
            return full + local_out.sum() * 0
        return full.index_copy(1, index, local_out)

    def _pad_index(self, full_keys: List[ColumnBlock], device) -> Optional[torch.Tensor]:
        """The full layout's column of each received column (None: the layouts are equal)."""
        local_keys = received_keys(self._local_shards)
        if local_keys == full_keys:
            return None
        start, column = 0, {}
        for key in full_keys:
            column[key] = start
            start += key[2] - key[1]
        index = [column[key] + c for key in local_keys for c in range(key[2] - key[1])]
        return torch.tensor(index, dtype=torch.int64, device=device)


def _column_span(table) -> Tuple[int, int]:
    """The columns ``[c0, c1)`` a row-split table's shards cover (the same for all of its shards)."""
    if not table.shards:
        return 0, table.config.embedding_dim
    return table.shards[0].col_start, table.shards[0].col_end


class RwPooledEmbeddingSharding(RowBucketRouting):
    """Row-wise pooled embeddings: ``[B_me, sum of dims]`` in :meth:`output_layout`."""

    def create_lookup(self) -> ShardedGroupedLookup:
        return ShardedGroupedLookup(
            self._sum_pooled_shards(),
            True,
            self.weighted,
            self.device,
            self.fused_optimizer,
            dtype=self.output_dtype,
        )

    def input_dist(
        self, ctx: ShardingContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if features.variable_stride_per_key() and not self._blocks_everywhere:
            # the same verdict on every rank (it depends on the plan only)
            raise ValueError(
                "row_wise with a variable batch per feature needs a non-empty block of every table on "
                f"every rank; tables {[t.name for t in self.tables]}"
            )
        if features.variable_stride_per_key() and self._mean_features:
            raise ValueError(
                f"row_wise MEAN features {self._mean_features} do not support a variable batch per "
                "feature; use SUM pooling, or table_wise / column_wise for these tables"
            )
        self._record_mean_lengths(ctx, features)
        return self._route(ctx, features, need_recat=False)

    def output_dist(self, ctx: ShardingContext, local_out: torch.Tensor) -> Awaitable[torch.Tensor]:
        codecs = self.codecs(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
        if ctx.variable_batch:
            return self._variable_batch_output_dist(ctx, local_out, codecs)
        full = self._pad_to(local_out, self.output_layout())
        summed = self._reduce_scatter(self.pg, codecs).forward(full, input_splits=ctx.stride_per_rank)
        return (
            MappedAwaitable(summed, lambda out: self._divide_means(out, ctx))
            if self._mean_features
            else summed
        )

    def _variable_batch_output_dist(self, ctx, local_out, codecs) -> Awaitable[torch.Tensor]:
        """Partial sums of flat per-feature blocks, reduce-scattered, then expanded to ``[B_me, dims]``."""
        keys = self.output_layout()
        widths = [c1 - c0 for _, c0, c1 in keys]
        bags = ctx.received.stride_per_key_per_rank()  # [keys][source rank]
        send = feature_major_to_rank_major(local_out, widths, bags)
        dist = VariableBatchPooledEmbeddingsReduceScatter(self.pg, codecs)
        awaitable = dist(send, bags_per_rank_per_feature(bags, self.world_size), widths)
        mine = [b[self.rank] for b in bags]
        position = {f: i for i, f in enumerate(self._feature_names)}
        features = [position[f] for f, _, _ in keys]
        return MappedAwaitable(
            awaitable, lambda flat: expand_blocks(flat, widths, mine, ctx.inverse_indices, features)
        )

    def output_layout(self) -> List[ColumnBlock]:
        return self._full_keys(self.tables)


class RwSequenceEmbeddingSharding(RowBucketRouting):
    """Row-wise sequence embeddings: ``{feature: [ids of this rank, dim]}``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._width = max((t.config.embedding_dim for t in self.tables), default=0)

    def create_lookup(self) -> ShardedGroupedLookup:
        return ShardedGroupedLookup(
            self._local_shards,
            False,
            False,
            self.device,
            self.fused_optimizer,
            self._width,
            self.output_dtype,
        )

    def input_dist(
        self, ctx: ShardingContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        ctx.input_counts = features.length_per_key()
        return self._route(ctx, features, need_recat=True)

    def output_dist(
        self, ctx: ShardingContext, local_out: torch.Tensor
    ) -> Awaitable[Dict[str, torch.Tensor]]:
        keys = [(f, 0, self._dims[f]) for f in self._feature_names]
        return self.sequence_output_dist(
            ctx, local_out, self._splits, ctx.input_counts, keys, self._dims, ctx.unbucketize
        )


__all__ = ["RowBucketRouting", "RwPooledEmbeddingSharding", "RwSequenceEmbeddingSharding"]
