"""Data-parallel sharding: every rank holds every table whole and looks up its own samples.

- input dist: none (the features are permuted into the lookup's group order, locally);
- lookup: ``ShardedGroupedLookup`` of whole tables. DENSE kernel: the tables get ordinary gradients,
  which the data-parallel wrapper of the model (DDP, or an all-reduce of the gradients) averages over
  ranks before a dense optimizer steps, exactly like the model's other replicated parameters. FUSED
  kernel (a collection with a fused optimizer): ``ReplicatedShardedLookup``, whose backward gathers
  every rank's touched rows and their gradients, then applies the fused optimizer on every replica
  alike (a plain fused lookup would update each replica from its own samples and let them drift
  apart);
  The DENSE kernel's tables are held as parameters of at most ``MAX_PARAMETER_BYTES`` each (runs of
  whole tables; a larger table alone), not one parameter per (width, dtype): the user's dense
  optimizer (``torch.optim.Adagrad``'s ``sqrt`` of its state, ``Adam``'s, ...) makes temporaries the
  size of each parameter every step, and one parameter of the whole table set (32 MiB in the
  vs_torchrec sweep) meant a fresh uncached allocation per step (~1.5x the optimizer's CPU time);
- output dist: none (the result is already this rank's samples). The gradient of input weights
  that require grad is divided by the world size here instead, as the other shardings' output dists
  divide it (while ``get_gradient_division()``).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from shardkit.distributed.awaitable import Awaitable, NoWait
from shardkit.distributed.comm_ops import get_gradient_division
from shardkit.sharding.embedding_lookup import PlacedShard, ShardedGroupedLookup, received_keys
from shardkit.sharding.embedding_sharding import (
    ColumnBlock,
    CommOpGradientScaling,
    EmbeddingShardingImpl,
    ShardingContext,
    TableShard,
    record_input,
    split_sequence_rows,
    with_weights,
)
from shardkit.sharding.key_permutation import KeyPermutation
from shardkit.sharding.replicated_fused_lookup import ReplicatedShardedLookup
from shardkit.sharding.types import EmbeddingComputeKernel
from shardkit.sharding.variable_batch import expand_blocks
from shardkit.sparse import KeyedJaggedTensor

_KERNELS = (EmbeddingComputeKernel.DENSE.value, EmbeddingComputeKernel.FUSED.value)
# 4 MiB: the optimizer's per-parameter temporaries stay cache-sized and are reused by the allocator,
# while a set of small tables still costs a few kernel calls, not one per table
MAX_PARAMETER_BYTES = 4 << 20


class DenseReplicaLookup(ShardedGroupedLookup):
    """The DENSE data-parallel lookup: each (width, dtype) group split into runs of whole tables of at
    most ``MAX_PARAMETER_BYTES`` (a larger table is a run alone), one parameter and kernel call each.
    The same rows and results as one group; only how the optimizer sees them differs (see module doc)."""

    def group(self, shards: List[PlacedShard]) -> List[List[PlacedShard]]:
        runs: List[List[PlacedShard]] = []
        for group in super().group(shards):
            run: List[PlacedShard] = []
            size = 0
            for table, shard in group:
                item = torch.empty((), dtype=table.config.dtype).element_size()
                nbytes = (shard.row_end - shard.row_start) * (shard.col_end - shard.col_start) * item
                if run and size + nbytes > MAX_PARAMETER_BYTES:
                    runs.append(run)
                    run, size = [], 0
                run.append((table, shard))
                size += nbytes
            runs.append(run)
        return runs


class _DataParallel(EmbeddingShardingImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for table in self.tables:
            if table.compute_kernel not in _KERNELS:
                raise ValueError(
                    f"table {table.name!r}: a data_parallel table uses the dense kernel (its gradients are "
                    f"averaged with the other replicated parameters) or the fused one (its fused optimizer "
                    f"applied to the all-reduced gradient), got {table.compute_kernel!r}"
                )
        self._whole = [
            (t, TableShard(self.rank, 0, t.config.num_embeddings, 0, t.config.embedding_dim))
            for t in self.tables
        ]
        self._keys: List[ColumnBlock] = received_keys(self._whole)
        position = {f: i for i, f in enumerate(self._feature_names)}
        self._permute = [position[f] for f, _, _ in self._keys]
        # tables of interleaved widths: every batch into the lookup's group order (the native segment
        # copy where it runs: 154 against 196 us for 48 features of 64 bags)
        in_order = self._permute == sorted(self._permute)
        self._key_permutation = None if in_order else KeyPermutation(self._permute)
        self._dims = {f: t.config.embedding_dim for t in self.tables for f in t.config.feature_names}

    def received_features(self) -> List[str]:
        return [f for f, _, _ in self._keys]

    def input_dist(
        self, ctx: ShardingContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        record_input(ctx, features)
        per_key = features.length_per_key()  # a new list per call: read once, not once per feature
        ctx.sent_lengths_per_key = [per_key[i] for i in self._permute]
        local = features if self._key_permutation is None else self._key_permutation.apply(features)
        weights = local.weights_or_none()
        if weights is not None and weights.requires_grad and get_gradient_division() and self.world_size > 1:
            # no output dist divides this gradient by the world size, as the other shardings' do: the
            # input weights' gradients then follow one convention whatever a feature's sharding
            local = with_weights(local, CommOpGradientScaling.apply(weights, 1.0 / self.world_size))
        ctx.sent_batches = local.stride_per_key()
        return NoWait(NoWait(local))

    def _lookup(self, *args, **kwargs) -> ShardedGroupedLookup:
        """The DENSE kernel's lookup, or the FUSED one's whose update is all-reduced first."""
        if self.fused_optimizer is None:
            return DenseReplicaLookup(*args, None, **kwargs)
        lookup = ReplicatedShardedLookup(*args, self.fused_optimizer, **kwargs)
        lookup.set_group(self.pg, self.world_size)
        return lookup


class DpPooledEmbeddingSharding(_DataParallel):
    """Data-parallel pooled embeddings: ``[B_me, sum of dims]`` in :meth:`output_layout`."""

    def create_lookup(self) -> ShardedGroupedLookup:
        return self._lookup(self._whole, True, self.weighted, self.device, dtype=self.output_dtype)

    def output_dist(self, ctx: ShardingContext, local_out: torch.Tensor) -> Awaitable[torch.Tensor]:
        if ctx.variable_batch:
            widths = [c1 - c0 for _, c0, c1 in self._keys]
            return NoWait(
                expand_blocks(local_out, widths, ctx.sent_batches, ctx.inverse_indices, self._permute)
            )
        return NoWait(local_out)

    def output_layout(self) -> List[ColumnBlock]:
        return list(self._keys)


class DpSequenceEmbeddingSharding(_DataParallel):
    """Data-parallel sequence embeddings: ``{feature: [ids of this rank, dim]}``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._width = max((t.config.embedding_dim for t in self.tables), default=0)

    def create_lookup(self) -> ShardedGroupedLookup:
        return self._lookup(
            self._whole, False, False, self.device, sequence_width=self._width, dtype=self.output_dtype
        )

    def output_dist(
        self, ctx: ShardingContext, local_out: torch.Tensor
    ) -> Awaitable[Dict[str, torch.Tensor]]:
        return NoWait(split_sequence_rows(local_out, ctx.sent_lengths_per_key, self._keys, self._dims))


__all__ = [
    "DenseReplicaLookup",
    "DpPooledEmbeddingSharding",
    "DpSequenceEmbeddingSharding",
    "MAX_PARAMETER_BYTES",
]
