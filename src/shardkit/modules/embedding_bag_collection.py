"""EmbeddingBagCollection: pooled embeddings of many sparse features, KeyedJaggedTensor -> KeyedTensor."""

from __future__ import annotations

from itertools import accumulate
from typing import List, Optional

import torch

from shardkit.modules.embedding_configs import EmbeddingBagConfig
from shardkit.modules.fused_groups import lookup_pooled_groups
from shardkit.modules.fused_optimizers import FusedOptimizerConfig
from shardkit.modules.grouped_tables import GroupedTablesModule
from shardkit.modules.tracing import is_fx_proxy, traced_leaf
from shardkit.sparse import KeyedJaggedTensor, KeyedTensor


class EmbeddingBagCollection(GroupedTablesModule):
    """Pooled lookups of a collection of tables (SUM or MEAN per table, optionally weighted).

    Args:
        tables: one :class:`EmbeddingBagConfig` per table; several features may share a table, and
            several tables may look up one feature.
        is_weighted: pool with the input's per-id weights (weighted sum; MEAN divides it by the bag
            length). The input must then carry weights.
        device: where the tables live; ``torch.device("meta")`` defers allocation until
            ``to_empty(device=...)`` + :meth:`reset_parameters`.
        fused_optimizer: apply this sparse optimizer during backward (no gradient on the tables).

    forward(features) -> KeyedTensor with one key per (table, feature), tables in declaration order and
    each table's features in order, ``values`` ``[B, sum of their embedding_dims]``; B is ``stride()``.
    A key is the feature's name, or ``feature@table`` for a feature that several tables look up (as
    torchrec). Input features no table looks up are ignored.
    A variable batch per feature is expanded to B rows through ``inverse_indices``.
    Dtype: the tables' (promoted across tables of different dtypes).
    State dict: ``embedding_bags.<table>.weight``; ``embedding_bags[<table>].weight`` is the table's
    rows (a :class:`~shardkit.modules.table_view.TableView`, not a parameter).
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        fused_optimizer: Optional[FusedOptimizerConfig] = None,
    ) -> None:
        super().__init__(tables, EmbeddingBagConfig, True, "embedding_bags", device, fused_optimizer)
        self._is_weighted = is_weighted
        self._lengths_per_embedding = [t.embedding_dim for t in tables for _ in t.feature_names]
        dim_of = dict(zip(self._embedding_names, self._lengths_per_embedding))
        # group outputs are concatenated group by group; this maps them to declaration order
        group_cols, start = {}, 0
        for name in self._group_embedding_order:
            group_cols[name] = range(start, start + dim_of[name])
            start += dim_of[name]
        columns = [c for name in self._embedding_names for c in group_cols[name]]
        self._column_order: Optional[List[int]] = None if columns == list(range(start)) else columns
        self._column_index = {}

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return list(self._tables)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if is_fx_proxy(features):  # torch.fx: one leaf call (shardkit.modules.tracing)
            return traced_leaf(self, features)
        if self._is_weighted and features.weights_or_none() is None:
            raise ValueError(
                "EmbeddingBagCollection(is_weighted=True) needs a KeyedJaggedTensor with weights"
            )
        # with a variable batch per feature, the full batch is the width of inverse_indices
        batch = (
            features.inverse_indices()[1].shape[1]
            if features.variable_stride_per_key()
            else features.stride()
        )
        parts = self._split_by_group(features)
        values = None
        if len(parts) > 1:
            # one autograd node for all groups (modules.fused_groups: the same result, ~0.06 ms less a group)
            dtype = self.lookups[0].weight.dtype
            values = lookup_pooled_groups(list(self.lookups), parts, dtype, self._is_weighted)
        if values is None:
            pooled = [self._pool_group(lookup, kjt, batch) for lookup, kjt in zip(self.lookups, parts)]
            values = torch.cat(pooled, dim=1) if len(pooled) > 1 else pooled[0]
        if self._column_order is not None:
            values = values.index_select(1, self._column_index_on(values.device))
        return KeyedTensor(self._embedding_names, self._lengths_per_embedding, values)

    def _pool_group(self, lookup, kjt: KeyedJaggedTensor, batch: int) -> torch.Tensor:
        """``[B, features * dim]`` of one group: feature f in columns ``[f * dim, (f + 1) * dim)``."""
        bags = kjt.stride_per_key()
        weights = kjt.weights_or_none() if self._is_weighted else None
        num_features, dim = len(bags), lookup.embedding_dim
        if not kjt.variable_stride_per_key():
            return lookup(kjt.values(), kjt.offsets(), bags, weights, sample_major=True)
        rows = lookup(kjt.values(), kjt.offsets(), bags, weights)  # [sum(bags), dim]
        # variable batch: row of sample b for feature f is bag start of f + inverse_indices[f, b]
        inverse = kjt.inverse_indices()[1].to(device=rows.device, dtype=torch.int64)
        starts = torch.tensor(list(accumulate([0, *bags[:-1]])), device=rows.device)
        rows = rows.index_select(0, (inverse + starts.unsqueeze(1)).reshape(-1))
        return rows.view(num_features, batch, dim).transpose(0, 1).reshape(batch, num_features * dim)

    def _column_index_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._column_index:
            self._column_index[device] = torch.tensor(self._column_order, device=device)
        return self._column_index[device]
