"""ManagedCollisionCollection: one managed collision module per table, KeyedJaggedTensor -> remapped KJT."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from shardkit.modules.embedding_configs import BaseEmbeddingConfig
from shardkit.modules.mc_modules import ManagedCollisionModule
from shardkit.modules.tracing import is_fx_proxy, refuse_script, traced_leaf
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor


class ManagedCollisionCollection(nn.Module):
    """Remaps each table's features through that table's managed collision module.

    Args:
        managed_collision_modules: ``{table name: module}``; every table of ``embedding_configs`` needs
            one whose ``output_size()`` is the table's ``num_embeddings``.
        embedding_configs: the tables (their features are remapped, all features of a table together).
        need_preprocess: run the modules' ``preprocess`` (input hash) first.

    forward(features: KJT with (at least) the tables' features) -> KJT of the tables' features in
    table order (each table's features in order), values the slots, lengths / weights / stride kept.
    In training mode the modules also profile the ids and may evict; :meth:`evict` reports it.
    State dict: ``_managed_collision_modules.<table>.<buffer>``.
    """

    def __init__(
        self,
        managed_collision_modules: Dict[str, ManagedCollisionModule],
        embedding_configs: Sequence[BaseEmbeddingConfig],
        need_preprocess: bool = True,
    ) -> None:
        super().__init__()
        self._managed_collision_modules = nn.ModuleDict(managed_collision_modules)
        self._embedding_configs = list(embedding_configs)
        self.need_preprocess = need_preprocess
        self._table_to_features = {c.name: list(c.feature_names) for c in self._embedding_configs}
        self._feature_to_table = {f: c.name for c in self._embedding_configs for f in c.feature_names}
        self._feature_names = [f for c in self._embedding_configs for f in c.feature_names]
        unknown = sorted(set(managed_collision_modules) - set(self._table_to_features))
        if unknown:
            raise ValueError(f"managed collision modules {unknown} name no table of embedding_configs")
        for config in self._embedding_configs:
            if config.name not in managed_collision_modules:
                raise ValueError(f"table {config.name!r} has no managed collision module")
            size = managed_collision_modules[config.name].output_size()
            if size != config.num_embeddings:
                raise ValueError(
                    f"table {config.name!r}: its managed collision module has {size} slots, "
                    f"the table {config.num_embeddings} rows"
                )
        self._permutations: Dict[tuple, Optional[List[int]]] = {}

    def embedding_configs(self) -> List[BaseEmbeddingConfig]:
        return list(self._embedding_configs)

    def __prepare_scriptable__(self) -> None:
        refuse_script(self)

    def feature_names(self) -> List[str]:
        return list(self._feature_names)

    def table_to_number_buckets(self) -> Dict[str, int]:
        return {t: m.buckets() for t, m in self._managed_collision_modules.items()}

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if is_fx_proxy(features):  # torch.fx: one leaf call (shardkit.modules.tracing)
            return traced_leaf(self, features)
        features = self.in_table_order(features)
        parts = features.split([len(self._table_to_features[c.name]) for c in self._embedding_configs])
        values: List[torch.Tensor] = []
        for config, kjt in zip(self._embedding_configs, parts):
            module = self._managed_collision_modules[config.name]
            table_input = {config.name: JaggedTensor(kjt.values(), lengths=kjt.lengths(), validate=False)}
            if self.need_preprocess:
                table_input = module.preprocess(table_input)
            values.append(module.remap(module.profile(table_input))[config.name].values())
        return replace_values(features, torch.cat(values) if len(values) > 1 else values[0])

    def in_table_order(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` permuted to the tables' feature order; ``KeyError`` naming missing features."""
        return in_feature_order(features, self._feature_names, self._permutations)

    def evict(self) -> Dict[str, Optional[torch.Tensor]]:
        """``{table: slots evicted since the last call (sorted int64) or None}``."""
        return {t: m.evict() for t, m in self._managed_collision_modules.items()}

    def open_slots(self) -> Dict[str, torch.Tensor]:
        return {t: m.open_slots() for t, m in self._managed_collision_modules.items()}


def in_feature_order(
    features: KeyedJaggedTensor, names: List[str], cache: Dict[tuple, Optional[List[int]]]
) -> KeyedJaggedTensor:
    """``features`` restricted and permuted to ``names`` (permutations cached per key tuple in ``cache``);
    ``KeyError`` naming the missing features."""
    keys = tuple(features.keys())
    if keys not in cache:
        missing = [f for f in names if f not in keys]
        if missing:
            raise KeyError(f"input lacks managed collision feature(s) {missing}; it has {list(keys)}")
        order = [keys.index(f) for f in names]
        cache[keys] = None if order == list(range(len(keys))) else order
    order = cache[keys]
    return features if order is None else features.permute(order)


def replace_values(features: KeyedJaggedTensor, values: torch.Tensor) -> KeyedJaggedTensor:
    """``features`` with ``values`` instead of its ids (keys, lengths, weights, strides kept)."""
    variable = features.variable_stride_per_key()
    return KeyedJaggedTensor(
        features.keys(),
        values,
        features.weights_or_none(),
        lengths=features.lengths(),
        stride=None if variable else features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() if variable else None,
        offset_per_key=features.offset_per_key_or_none(),
        inverse_indices=features.inverse_indices_or_none(),
        validate=False,
    )


__all__ = ["ManagedCollisionCollection", "in_feature_order", "replace_values"]
