"""Table-wise sharding: each table lives whole on one rank.

- input dist: the features are permuted so that each rank's features are contiguous (for each rank,
  the keys :func:`~shardkit.sharding.embedding_lookup.received_keys` of its shards), then one
  ``KJTAllToAll`` with one split per rank;
- lookup: ``ShardedGroupedLookup`` of the rank's tables, over every rank's samples;
- output dist: pooled, ``PooledEmbeddingsAllToAll`` (each rank gets its own samples' rows, columns
  in rank order); sequence, ``SequenceEmbeddingsAllToAll`` (each id's row back to where it came from).

Column-wise and table-column-wise sharding route their column blocks the same way (a block is a
table of its own to the dists), so they reuse :class:`PermuteRouting` and these shardings.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from shardkit.distributed.awaitable import Awaitable
from shardkit.distributed.comm_ops.placement import ColumnPlacement
from shardkit.sharding.dist_data import (
    PooledEmbeddingsAllToAll,
    VariableBatchPooledEmbeddingsAllToAll,
)
from shardkit.sharding.embedding_lookup import ShardedGroupedLookup, received_keys
from shardkit.sharding.embedding_sharding import (
    ColumnBlock,
    EmbeddingShardingImpl,
    MappedAwaitable,
    ShardingContext,
    record_input,
    start_kjt_all_to_all,
)
from shardkit.sharding.key_permutation import KeyPermutation
from shardkit.sharding.types import CommOp
from shardkit.sharding.variable_batch import (
    bags_per_rank_per_feature,
    expand_blocks,
    feature_major_to_rank_major,
)
from shardkit.sparse import KeyedJaggedTensor


class PermuteRouting(EmbeddingShardingImpl):
    """Shardings whose shards take whole features: every id of a feature goes to each shard of its table.

    Builds, from the shards' placements, each rank's received keys, the permutation of the input
    features into rank order (a feature repeats once per shard of its table) and the splits.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        per_rank = [
            [(t, s) for t in self.tables for s in t.shards if s.rank == r and not s.empty]
            for r in range(self.world_size)
        ]
        self._local_shards = per_rank[self.rank]
        self._keys_per_rank: List[List[ColumnBlock]] = [received_keys(shards) for shards in per_rank]
        position = {f: i for i, f in enumerate(self._feature_names)}
        self._permute = [position[f] for keys in self._keys_per_rank for f, _, _ in keys]
        self._identity = self._permute == list(range(len(self._feature_names)))
        self._key_permutation = KeyPermutation(self._permute)  # its index tensors built once
        self._splits = [len(keys) for keys in self._keys_per_rank]
        self._dims_per_rank: Optional[List[int]] = None
        self._pooled_dist: Optional[tuple] = None  # (codecs, PooledEmbeddingsAllToAll), built once
        self._sent_keys: List[ColumnBlock] = [key for keys in self._keys_per_rank for key in keys]
        self._dims = {f: t.config.embedding_dim for t in self.tables for f in t.config.feature_names}

    def received_features(self) -> List[str]:
        return [f for f, _, _ in self._keys_per_rank[self.rank]]

    def _route(self, ctx: ShardingContext, features: KeyedJaggedTensor, need_recat: bool):
        record_input(ctx, features)
        send = features if self._identity else self._key_permutation.apply(features)
        return start_kjt_all_to_all(
            ctx, self.pg, send, self._splits, need_recat=need_recat, slots=self.input_slots
        )


class TwPooledEmbeddingSharding(PermuteRouting):
    """Table-wise (and column-wise) pooled embeddings: ``[B_me, sum of widths]`` in :meth:`output_layout`."""

    def create_lookup(self) -> ShardedGroupedLookup:
        return ShardedGroupedLookup(
            self._local_shards,
            True,
            self.weighted,
            self.device,
            self.fused_optimizer,
            dtype=self.output_dtype,
        )

    def input_dist(
        self, ctx: ShardingContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return self._route(ctx, features, need_recat=False)

    def dims_per_rank(self) -> List[int]:
        """Columns each rank computes (the widths of its received keys)."""
        return [sum(c1 - c0 for _, c0, c1 in keys) for keys in self._keys_per_rank]

    def output_dist(
        self, ctx: ShardingContext, local_out: torch.Tensor, placement: Optional[ColumnPlacement] = None
    ) -> Awaitable[torch.Tensor]:
        """``placement``: put the output's columns in its order rather than :meth:`output_layout`'s (not
        for a variable batch: :meth:`placed` says whether it was applied)."""
        codecs = self.codecs(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL)
        if ctx.variable_batch:
            return self._variable_batch_output_dist(ctx, local_out, codecs)
        if (
            self._pooled_dist is None
            or self._pooled_dist[0] is not codecs
            or self._pooled_dist[1] is not placement
        ):
            # per plan, not per step: the dims summed and the dist module built once (an nn.Module
            # costs ~20-30 us to construct)
            self._dims_per_rank = self.dims_per_rank()
            dist = PooledEmbeddingsAllToAll(self.pg, self._dims_per_rank, codecs=codecs, placement=placement)
            self._pooled_dist = (codecs, placement, dist)
        # its forward called directly: the dist is this sharding's own, in no module tree (no hooks
        # to run), and nn.Module's call machinery costs ~8 Python calls per step
        return self._pooled_dist[2].forward(local_out, batch_size_per_rank=ctx.stride_per_rank)

    @staticmethod
    def placed(ctx: ShardingContext) -> bool:
        """Whether :meth:`output_dist` applies a placement to this context's output."""
        return not ctx.variable_batch

    def _variable_batch_output_dist(self, ctx, local_out, codecs) -> Awaitable[torch.Tensor]:
        """Flat per-feature blocks to their ranks, then expanded to ``[B_me, sum widths]``."""
        widths = [[c1 - c0 for _, c0, c1 in keys] for keys in self._keys_per_rank]
        bags = ctx.received.stride_per_key_per_rank()  # [local keys][source rank]
        send = feature_major_to_rank_major(local_out, widths[self.rank], bags)
        dist = VariableBatchPooledEmbeddingsAllToAll(self.pg, widths, codecs=codecs)
        awaitable = dist(send, bags_per_rank_per_feature(bags, self.world_size), ctx.sent_batches)
        sent_widths = [c1 - c0 for _, c0, c1 in self._sent_keys]

        def expand(flat: torch.Tensor) -> torch.Tensor:
            return expand_blocks(flat, sent_widths, ctx.sent_batches, ctx.inverse_indices, self._permute)

        return MappedAwaitable(awaitable, expand)

    def output_layout(self) -> List[ColumnBlock]:
        return list(self._sent_keys)


class TwSequenceEmbeddingSharding(PermuteRouting):
    """Table-wise (and column-wise) sequence embeddings: ``{feature: [ids of this rank, dim]}``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._width = max((c1 - c0 for _, c0, c1 in self._sent_keys), default=0)

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
        return self._route(ctx, features, need_recat=True)

    def output_dist(
        self, ctx: ShardingContext, local_out: torch.Tensor
    ) -> Awaitable[Dict[str, torch.Tensor]]:
        return self.sequence_output_dist(
            ctx, local_out, self._splits, ctx.sent_lengths_per_key, self._sent_keys, self._dims
        )


__all__ = ["PermuteRouting", "TwPooledEmbeddingSharding", "TwSequenceEmbeddingSharding"]
