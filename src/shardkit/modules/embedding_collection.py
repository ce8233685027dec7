"""EmbeddingCollection: one embedding per id (no pooling), KeyedJaggedTensor -> dict of JaggedTensor."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from shardkit.modules.embedding_configs import EmbeddingConfig
from shardkit.modules.fused_optimizers import FusedOptimizerConfig
from shardkit.modules.grouped_tables import GroupedTablesModule
from shardkit.modules.tracing import is_fx_proxy, traced_leaf
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor


class EmbeddingCollection(GroupedTablesModule):
    """Sequence (unpooled) lookups of a collection of tables.

    Args:
        tables: one :class:`EmbeddingConfig` per table; several features may share a table.
        device: as for :class:`~shardkit.modules.EmbeddingBagCollection` (meta allowed).
        need_indices: also return each feature's ids, as the JaggedTensor's ``weights``.
        fused_optimizer: apply this sparse optimizer during backward.

    forward(features) -> ``{name: JaggedTensor}`` in declaration order; a feature's values are
    ``[ids of that feature, embedding_dim]`` in its table's dtype, lengths as in the input. The name is
    the feature's, or ``feature@table`` for a feature that several tables look up (as torchrec).
    Input features no table looks up are ignored.
    State dict: ``embeddings.<table>.weight``; ``embeddings[<table>].weight`` is the table's rows.
    """

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: Optional[torch.device] = None,
        need_indices: bool = False,
        fused_optimizer: Optional[FusedOptimizerConfig] = None,
    ) -> None:
        super().__init__(tables, EmbeddingConfig, False, "embeddings", device, fused_optimizer)
        self._need_indices = need_indices

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return list(self._tables)

    def need_indices(self) -> bool:
        return self._need_indices

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        if is_fx_proxy(features):  # torch.fx: one leaf call (shardkit.modules.tracing)
            return traced_leaf(self, features)
        out: Dict[str, JaggedTensor] = {}
        names = iter(self._group_embedding_order)
        for lookup, kjt in zip(self.lookups, self._split_by_group(features)):
            ids = kjt.values()
            rows = lookup(ids, kjt.offsets(), kjt.stride_per_key())  # [N, dim]
            counts = kjt.length_per_key()  # cached by the split: no further host sync
            # by position: a feature of several tables is repeated in the group's keys
            for embeddings, key_ids, lengths in zip(
                rows.split(counts), ids.split(counts), kjt.lengths().split(kjt.stride_per_key())
            ):
                out[next(names)] = JaggedTensor(
                    embeddings, key_ids if self._need_indices else None, lengths=lengths, validate=False
                )
        return {name: out[name] for name in self._embedding_names}
