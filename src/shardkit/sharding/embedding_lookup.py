"""The lookup a rank runs on its own shards: shards grouped by (width, dtype), one kernel call per group.

Every sharding type computes with this module; only which shards a rank holds and which features
arrive differ. It reuses ``shardkit.modules.GroupedEmbeddingLookup`` (shards as ``ShardSpec`` row and
column ranges of their tables, the fused optimizers in backward), so a shard is looked up by exactly
the code the unsharded module runs.

The received KeyedJaggedTensor must hold, in order, for each group, for each of its shards, the
features of the shard's table (:attr:`ShardedGroupedLookup.keys`); the input dists send them so.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from shardkit.modules.fused_groups import FusedGroupsLookup, lookup_pooled_groups
from shardkit.modules.fused_optimizers import FusedOptimizerConfig
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup
from shardkit.modules.offloaded_lookup import OffloadedEmbeddingLookup, sum_cache_stats
from shardkit.sharding.embedding_sharding import ColumnBlock, ShardedTable, TableShard
from shardkit.sparse import KeyedJaggedTensor

PlacedShard = Tuple[ShardedTable, TableShard]


def group_shards(shards: List[PlacedShard]) -> List[List[PlacedShard]]:
    """Shards grouped by (width, data type), groups and members in order of first appearance; an
    offloaded shard is a group of its own (one backing file and cache per shard, with its own params)."""
    groups: Dict[Tuple, List[PlacedShard]] = {}
    for table, shard in shards:
        key = (shard.col_end - shard.col_start, table.config.data_type)
        if table.offload is not None:
            key = (*key, table.name, shard.row_start, shard.col_start)
        groups.setdefault(key, []).append((table, shard))
    return list(groups.values())


def received_keys(shards: List[PlacedShard]) -> List[ColumnBlock]:
    """(feature, first column, end column) of each feature a rank holding ``shards`` receives, in order."""
    return [
        (f, shard.col_start, shard.col_end)
        for group in group_shards(shards)
        for table, shard in group
        for f in table.config.feature_names
    ]


class ShardedGroupedLookup(nn.Module):
    """This rank's shards in one ``GroupedEmbeddingLookup`` per (width, dtype) group.

    Args:
        shards: the (table, shard) pairs this rank holds (non-empty shards only).
        pooled: bags or one row per id.
        weighted: pool with the input's per-id weights (pooled only).
        device, fused_optimizer: see ``GroupedEmbeddingLookup``.
        sequence_width: sequence lookups pad every group's rows to this width, so that one output
            dist carries all groups (the widest shard of the sharding, the same on every rank).
        dtype: the output's dtype, the same on every rank (default: float32); groups of another
            dtype are converted.

    Subclasses may set ``group_lookup_class`` (``shardkit.sharding.quant_sharding`` stores quantized
    groups), called as ``GroupedEmbeddingLookup`` is, and ``offloaded_lookup_class`` (the lookup of a
    shard whose table has an offloading kernel: one group per such shard, with its ``OffloadSpec``).

    forward(kjt) with the features of :attr:`keys` in order, stride R (sum of the ranks' batches):

    - pooled: ``[R, sum of the keys' widths]``, key k's block at its place in :attr:`keys`;
    - sequence: ``[ids, sequence_width]``, key by key.

    Both require grad even when this rank holds no shard (an empty ``[R, 0]`` / ``[0, width]``), since
    every rank must take part in the output dist's backward; weights that require grad are then kept
    in the graph too, for the KJT all-to-all's backward.
    """

    group_lookup_class = GroupedEmbeddingLookup
    # the autograd Function that runs several such groups as one node (modules.fused_groups); None:
    # each group alone (a subclass whose groups run kernels of their own sets None)
    groups_function: Optional[type] = FusedGroupsLookup
    offloaded_lookup_class = OffloadedEmbeddingLookup

    def __init__(
        self,
        shards: List[PlacedShard],
        pooled: bool,
        weighted: bool = False,
        device: Optional[torch.device] = None,
        fused_optimizer: Optional[FusedOptimizerConfig] = None,
        sequence_width: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.pooled, self.weighted, self.sequence_width = pooled, weighted, sequence_width
        self.dtype = dtype
        self.placed: List[List[PlacedShard]] = self.group(shards)
        self.lookups = nn.ModuleList(
            self._group_lookup(group, device, fused_optimizer) for group in self.placed
        )
        self.keys: List[ColumnBlock] = received_keys(shards)
        self._offloaded = any(hasattr(lookup, "offload") for lookup in self.lookups)
        self._group_sizes = [len(lookup.feature_names) for lookup in self.lookups]
        # the last three inputs split, newest last (see _split)
        self._last_splits: List[Tuple[KeyedJaggedTensor, List[KeyedJaggedTensor]]] = []

    def group(self, shards: List[PlacedShard]) -> List[List[PlacedShard]]:
        """The shards of each kernel call (default ``group_shards``); a subclass may split a group
        into consecutive runs, which keeps :attr:`keys`' order (the flattened groups')."""
        return group_shards(shards)

    def _group_lookup(self, group: List[PlacedShard], device, fused_optimizer) -> nn.Module:
        specs = [t.spec(s) for t, s in group]
        table, shard = group[0]
        if table.offload is None:
            return self.group_lookup_class(specs, self.pooled, device, fused_optimizer)
        identity = {"kernel": table.compute_kernel, "rank": shard.rank}
        return self.offloaded_lookup_class(
            specs, self.pooled, device, fused_optimizer, table.offload, identity
        )

    @torch.no_grad()
    def load_tables(self, table_weight) -> None:
        """Copy each shard's rows and columns from ``table_weight(name)`` (a full ``[rows, cols]`` table)."""
        for lookup, group in zip(self.lookups, self.placed):
            for i, (table, shard) in enumerate(group):
                full = table_weight(table.name)
                lookup.shard_rows(i).copy_(
                    full[shard.row_start : shard.row_end, shard.col_start : shard.col_end]
                )

    def local_shards(self) -> Dict[Tuple[str, int, int, int, int], torch.Tensor]:
        """``(table, row_start, row_end, col_start, col_end)`` -> view of that shard's weights."""
        return {
            (t.name, s.row_start, s.row_end, s.col_start, s.col_end): lookup.shard_rows(i)
            for lookup, group in zip(self.lookups, self.placed)
            for i, (t, s) in enumerate(group)
        }

    def prefetch(self, kjt: KeyedJaggedTensor) -> None:
        """Prefetch each offloaded group's rows of ``kjt`` (the input :meth:`forward` will take)."""
        if not self.lookups or not self._offloaded:
            return
        parts = self._split(kjt)
        for lookup, part in zip(self.lookups, parts):
            if isinstance(lookup, OffloadedEmbeddingLookup) and lookup.offload.prefetch:  # training tables
                lookup.prefetch(part.values(), part.offsets(), part.stride_per_key())

    def _split(self, kjt: KeyedJaggedTensor) -> List[KeyedJaggedTensor]:
        """``kjt`` split into the groups' features; the same part objects again for the same ``kjt``
        (one of the last three used: batch i's forward and batch i+2's prefetch come between batch
        i+1's prefetch and its forward): a prefetch
        and its forward then pass the lookup the same ids and offsets tensors, which it matches by
        identity (comparing values would be a host sync on a GPU)."""
        if len(self.lookups) == 1:
            return [kjt]
        kept = [parts for split, parts in self._last_splits if split is kjt]
        parts = kept[0] if kept else kjt.split(self._group_sizes)
        others = [entry for entry in self._last_splits if entry[0] is not kjt]
        self._last_splits = [*others[-2:], (kjt, parts)]  # the last three used, newest last
        return parts

    def cache_stats(self) -> Dict[str, Dict[str, float]]:
        """Each offloaded table's cache counters (see ``OffloadedEmbeddingLookup.cache_stats``)."""
        return sum_cache_stats(
            [lookup.cache_stats() for lookup in self.lookups if hasattr(lookup, "cache_stats")]
        )

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        flat = self.pooled and kjt.variable_stride_per_key()
        if not self.lookups:
            device = kjt.values().device
            shape = (0,) if flat else (kjt.stride(), 0) if self.pooled else (0, self.sequence_width)
            empty = torch.zeros(shape, dtype=self.dtype, device=device, requires_grad=True)
            weights = kjt.weights_or_none() if self.weighted else None
            if weights is not None and weights.requires_grad:
                # the received weights' backward is an all-to-all that the ranks using theirs wait in
                return empty + weights.sum() * 0
            return empty
        parts = self._split(kjt)
        if self.pooled and not flat and len(self.lookups) > 1 and self.groups_function is not None:
            # one autograd node for all groups (modules.fused_groups: the same result, ~0.06 ms less a group)
            lookups, function, kind = list(self.lookups), self.groups_function, self.group_lookup_class
            fused = lookup_pooled_groups(lookups, parts, self.dtype, self.weighted, function, kind)
            if fused is not None:
                return fused
        outs = [self._lookup_group(lookup, part).to(self.dtype) for lookup, part in zip(self.lookups, parts)]
        if len(outs) == 1:
            return outs[0]
        return torch.cat(outs, dim=1 if self.pooled and not flat else 0)

    def _lookup_group(self, lookup: GroupedEmbeddingLookup, kjt: KeyedJaggedTensor) -> torch.Tensor:
        bags = kjt.stride_per_key()
        weights = kjt.weights_or_none() if self.weighted else None
        if self.pooled and not kjt.variable_stride_per_key():
            # [R, features * width], sample rows in the received (rank) order, written so by the kernel
            return lookup(kjt.values(), kjt.offsets(), bags, weights, sample_major=True)
        rows = lookup(kjt.values(), kjt.offsets(), bags, weights)
        if not self.pooled:
            pad = self.sequence_width - rows.size(1)
            return rows if pad == 0 else torch.nn.functional.pad(rows, (0, pad))
        # variable batch: flat per-feature blocks [bags of feature f * width] (the variable-batch layout)
        return rows.reshape(-1)


__all__ = ["PlacedShard", "ShardedGroupedLookup", "group_shards", "received_keys"]
