"""What EmbeddingBagCollection and EmbeddingCollection share: tables grouped into lookups.

Tables are grouped by (embedding_dim, data_type) in order of first appearance; each group is one
:class:`GroupedEmbeddingLookup`. This base class routes a KeyedJaggedTensor's features to the groups
(one permute and one split, both views or one copy, never a loop over samples), exposes each table's
rows as a view of its group's buffer, and keeps the state dict keyed by table
(``<prefix><table>.weight``) whatever the grouping.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from shardkit.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    check_table_configs,
    embedding_names_by_table,
)
from shardkit.modules.fused_optimizer_state import FusedOptimizer
from shardkit.modules.fused_optimizers import FusedOptimizerConfig
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup, ShardSpec
from shardkit.modules.table_view import TableView
from shardkit.modules.tracing import refuse_script
from shardkit.sparse import KeyedJaggedTensor


def group_table_configs(tables: Sequence[BaseEmbeddingConfig]) -> List[List[BaseEmbeddingConfig]]:
    """Tables grouped by (embedding_dim, data_type), groups and members in order of first appearance
    (the data type decides the dtype, and a quantized module's storage)."""
    groups: Dict[Tuple[int, DataType], List[BaseEmbeddingConfig]] = {}
    for table in tables:
        groups.setdefault((table.embedding_dim, table.data_type), []).append(table)
    return list(groups.values())


class GroupedTablesModule(nn.Module):
    """Base of the collections: owns ``lookups`` (one per group) and the table bookkeeping.

    Args:
        tables: table configs, already of the subclass's config type.
        config_type: EmbeddingBagConfig or EmbeddingConfig (checked).
        pooled: passed to each group.
        state_prefix: state-dict name of the per-table modules (``embedding_bags`` / ``embeddings``),
            also the attribute holding one :class:`TableView` per table, as torchrec's ModuleDict.
        device, fused_optimizer: see :class:`GroupedEmbeddingLookup`.

    Input: a KeyedJaggedTensor with (at least) every feature of the tables, in any order; features no
    table looks up are ignored, so one KJT can feed several modules.

    Subclasses may set ``lookup_class`` (the quantized modules store their groups in
    ``shardkit.quant``'s lookup, which takes the same arguments).
    """

    lookup_class = GroupedEmbeddingLookup

    def __init__(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        config_type: type,
        pooled: bool,
        state_prefix: str,
        device: Optional[torch.device],
        fused_optimizer: Optional[FusedOptimizerConfig],
    ) -> None:
        super().__init__()
        self._feature_to_tables = check_table_configs(tables, config_type)
        self._tables = list(tables)
        names_by_table = embedding_names_by_table(self._tables)
        self._embedding_names = [name for names in names_by_table for name in names]
        self._state_prefix = state_prefix
        self.lookups = nn.ModuleList(
            self.lookup_class([ShardSpec(t) for t in group], pooled, device, fused_optimizer)
            for group in group_table_configs(self._tables)
        )
        # where each table lives: (group index, shard index)
        self._table_location = {
            shard.table_name: (g, s)
            for g, lookup in enumerate(self.lookups)
            for s, shard in enumerate(lookup.shards)
        }
        self._group_sizes = [len(lookup.feature_names) for lookup in self.lookups]
        self._group_feature_order = [f for lookup in self.lookups for f in lookup.feature_names]
        table_names = {t.name: names for t, names in zip(self._tables, names_by_table)}
        # the output names in the groups' order: what the lookups produce, before reordering
        self._group_embedding_order = [
            name
            for lookup in self.lookups
            for shard in lookup.shards
            for name in table_names[shard.table_name]
        ]
        self._permutations: Dict[Tuple[str, ...], Optional[List[int]]] = {}
        self._fused_optimizer = (
            None if fused_optimizer is None else FusedOptimizer(fused_optimizer, list(self.lookups))
        )
        setattr(self, state_prefix, nn.ModuleDict({t.name: TableView(self, t) for t in self._tables}))
        self.register_state_dict_post_hook(_tables_to_state_dict)
        self.register_load_state_dict_pre_hook(_tables_from_state_dict)

    def __prepare_scriptable__(self) -> None:
        refuse_script(self)  # TypeError naming torch.export / torch.fx (shardkit.modules.tracing)

    # ---- tables -------------------------------------------------------------------------------

    def feature_names(self) -> List[str]:
        """The features the tables look up, each once, in declaration order."""
        return list(self._feature_to_tables)

    def embedding_names(self) -> List[str]:
        """The output keys: per table its features, ``feature@table`` for a feature of several tables."""
        return list(self._embedding_names)

    @property
    def device(self) -> torch.device:
        """Where the tables live (``meta`` before ``to_empty``)."""
        return self.lookups[0].weight.device

    def table_weight(self, name: str) -> torch.Tensor:
        """Table ``name``'s rows ``[num_embeddings, embedding_dim]``: a view of its group's buffer."""
        group, shard = self._locate(name)
        return self.lookups[group].shard_rows(shard)

    def table_grad(self, name: str) -> Optional[torch.Tensor]:
        """View of the dense gradient of table ``name`` (None before backward or with a fused optimizer)."""
        group, shard = self._locate(name)
        grad = self.lookups[group].weight.grad
        return None if grad is None else self.lookups[group].shard_rows(shard, grad)

    def _locate(self, name: str) -> Tuple[int, int]:
        if name not in self._table_location:
            raise KeyError(f"unknown table '{name}'; tables: {list(self._table_location)}")
        return self._table_location[name]

    def reset_parameters(self) -> None:
        """(Re)initialize every table from its config and zero the fused optimizer state.

        The second step of meta-device construction: ``module.to_empty(device=d)``, then this.
        """
        for lookup in self.lookups:
            lookup.reset_parameters()

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The optimizer applied during backward; ValueError if the module was built without one."""
        if self._fused_optimizer is None:
            raise ValueError(f"{type(self).__name__} was built without fused_optimizer")
        return self._fused_optimizer

    # ---- input routing ------------------------------------------------------------------------

    def _split_by_group(self, features: KeyedJaggedTensor) -> List[KeyedJaggedTensor]:
        """The input's features reordered into the groups' order and split per group."""
        if features.values().dim() != 1:
            raise ValueError(
                f"{type(self).__name__}: the input's values must be [N] ids, got shape "
                f"{tuple(features.values().shape)} (a KeyedJaggedTensor of [N, D] rows cannot be looked up)"
            )
        keys = tuple(features.keys())
        if keys not in self._permutations:
            self._permutations[keys] = self._permutation(keys)
        order = self._permutations[keys]
        if order is not None:
            features = features.permute(order)
        return features.split(self._group_sizes)

    def _permutation(self, keys: Tuple[str, ...]) -> Optional[List[int]]:
        owner = type(self).__name__
        if len(set(keys)) != len(keys):
            raise KeyError(f"{owner}: input features {list(keys)} contain a repeated key")
        missing = [f for f in self._feature_to_tables if f not in keys]
        if missing:
            raise KeyError(f"{owner}: input lacks feature(s) {missing}; it has {list(keys)}")
        if list(keys) == self._group_feature_order:
            return None
        position = {k: i for i, k in enumerate(keys)}
        return [position[f] for f in self._group_feature_order]


def _tables_to_state_dict(module: GroupedTablesModule, state_dict, prefix: str, local_metadata) -> None:
    buffers = [state_dict.pop(f"{prefix}lookups.{g}.weight") for g in range(len(module.lookups))]
    for table in module._tables:  # declaration order, not group order
        g, s = module._table_location[table.name]
        state_dict[f"{prefix}{module._state_prefix}.{table.name}.weight"] = module.lookups[g].shard_rows(
            s, buffers[g]
        )


def _tables_from_state_dict(
    module: GroupedTablesModule,
    state_dict,
    prefix,
    local_metadata,
    strict,
    missing_keys,
    unexpected_keys,
    error_msgs,
) -> None:
    # rebuild each group's buffer from its tables so that nn.Module's own loading (shape checks,
    # strict missing / unexpected keys) does the rest
    for g, lookup in enumerate(module.lookups):
        names = [f"{prefix}{module._state_prefix}.{shard.table_name}.weight" for shard in lookup.shards]
        if all(name in state_dict for name in names):
            parts = [state_dict.pop(name) for name in names]
            shapes = [tuple(p.shape) for p in parts]
            # the stored shapes ([rows, cols], or a quantized group's [rows, row bytes])
            expected = [tuple(lookup.shard_rows(i).shape) for i in range(len(lookup.shards))]
            if shapes != expected:
                error_msgs.append(f"table shapes {shapes} do not match the configs {expected} ({names})")
                continue
            state_dict[f"{prefix}lookups.{g}.weight"] = torch.cat(parts)
