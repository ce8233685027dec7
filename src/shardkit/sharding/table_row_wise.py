"""Table-row-wise sharding: a table's rows in blocks over the ranks of one node.

Ranks are numbered node by node: rank ``h * L + l`` is local rank ``l`` of node ``h`` (``L`` ranks per
node, ``H`` nodes). For pooled embeddings:

- input dist: row-wise block bucketization (:class:`~shardkit.sharding.row_wise.RowBucketRouting`),
  over the blocks' ranks, with the KJT all-to-all's ``stagger = H``: the received rows of each
  feature come grouped by source *local rank* (sources ``l, L + l, 2L + l, ...`` for ``l = 0, 1, ...``);
- lookup: the rank's block of each table of its node, over every rank's samples (partial sums);
- output dist, in two steps so that the partial sums cross nodes once:
  1. intra-node ``PooledEmbeddingsReduceScatter``: local rank ``l`` gets the node's summed rows of the
     samples of every rank with local rank ``l``;
  2. cross-node ``PooledEmbeddingsAllToAll`` among the ranks of local rank ``l`` (one per node): each
     node's columns of rank ``(h, l)``'s samples go to it.

The groups come from ``shardkit.distributed.intra_and_cross_node_pg``. Sequence embeddings need no
reduction, so they use row-wise sharding's dists over the same blocks.
"""

from __future__ import annotations

from typing import List

import torch

from shardkit.distributed.awaitable import Awaitable
from shardkit.distributed.topology import intra_and_cross_node_pg
from shardkit.sharding.dist_data import PooledEmbeddingsAllToAll
from shardkit.sharding.embedding_lookup import ShardedGroupedLookup
from shardkit.sharding.embedding_sharding import ColumnBlock, MappedAwaitable, ShardingContext
from shardkit.sharding.row_wise import RowBucketRouting, RwSequenceEmbeddingSharding
from shardkit.sharding.types import CommOp
from shardkit.sparse import KeyedJaggedTensor


class TwRwPooledEmbeddingSharding(RowBucketRouting):
    """Table-row-wise pooled embeddings: ``[B_me, sum of dims]`` in :meth:`output_layout`.

    Raises ``ValueError`` for a table whose blocks are not all on one node. Construction is
    collective (it creates or fetches the node groups).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._intra_pg, self._cross_pg = intra_and_cross_node_pg(self.device)
        intra_size = 1 if self._intra_pg is None else torch.distributed.get_world_size(self._intra_pg)
        self._local_size = intra_size
        self._num_nodes = self.world_size // intra_size
        self.stagger = self._num_nodes
        node_of = [r // intra_size for r in range(self.world_size)]
        self._tables_per_node: List[list] = [[] for _ in range(self._num_nodes)]
        for table in self.tables:
            nodes = {node_of[s.rank] for s in table.shards}
            if len(nodes) != 1:
                raise ValueError(
                    f"table {table.name!r}: {table.sharding_type} row blocks (columns "
                    f"{[table.shards[0].col_start, table.shards[0].col_end]}) must be on one node of "
                    f"{intra_size} ranks, got ranks {[s.rank for s in table.shards]}"
                )
            self._tables_per_node[nodes.pop()].append(table)
        self._node = self.rank // intra_size
        self._local_rank = self.rank % intra_size

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
        if features.variable_stride_per_key():
            raise ValueError(
                f"{self.tables[0].sharding_type} tables {sorted({t.name for t in self.tables})} do not "
                "support a variable batch per feature; use row_wise or table_wise"
            )
        self._record_mean_lengths(ctx, features)
        return self._route(ctx, features, need_recat=False)

    def output_dist(self, ctx: ShardingContext, local_out: torch.Tensor) -> Awaitable[torch.Tensor]:
        full = self._pad_to(local_out, self._full_keys(self._tables_per_node[self._node]))
        L, H = self._local_size, self._num_nodes
        batch = ctx.stride_per_rank
        # received rows are grouped by source local rank l, nodes in order within each group
        rows_per_local_rank = [sum(batch[h * L + lr] for h in range(H)) for lr in range(L)]
        reduce_scatter = self._reduce_scatter(
            self._intra_pg, self.codecs(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
        )
        summed = reduce_scatter.forward(full, input_splits=rows_per_local_rank)
        if H == 1 and self.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL) is None:
            # one node: the reduce-scatter's result is already this rank's [B_me, node dims]; the
            # cross-node all-to-all over a group of one would only copy it (twice: pack and cat),
            # and its backward copy the gradient once more. (With a codec it stays: the codec's
            # rounding is part of the result.)
            out = summed
        else:
            out = self._cross_node_dist(summed, batch)
        return (
            MappedAwaitable(out, lambda pooled: self._divide_means(pooled, ctx))
            if self._mean_features
            else out
        )

    def _cross_node_dist(self, summed: Awaitable[torch.Tensor], batch: List[int]) -> Awaitable[torch.Tensor]:
        """Output dist step 2 (several nodes): each node's columns of rank ``(h, l)``'s samples to it."""
        H = self._num_nodes
        L = self._local_size
        dims = [sum(c1 - c0 for _, c0, c1 in self._full_keys(tables)) for tables in self._tables_per_node]
        all_to_all = PooledEmbeddingsAllToAll(
            self._cross_pg, dims, codecs=self.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
        )
        cross_batch = [batch[h * L + self._local_rank] for h in range(H)]
        # the second collective needs the first's result; it is started here rather than when the
        # output is first used, so that every rank issues its collectives in the same order
        return all_to_all(summed.wait(), batch_size_per_rank=cross_batch)

    def output_layout(self) -> List[ColumnBlock]:
        return [key for tables in self._tables_per_node for key in self._full_keys(tables)]


class TwRwSequenceEmbeddingSharding(RwSequenceEmbeddingSharding):
    """Table-row-wise sequence embeddings: row-wise's dists over the node's blocks."""


__all__ = ["TwRwPooledEmbeddingSharding", "TwRwSequenceEmbeddingSharding"]
