"""``EmbeddingShardingInfo``: one table of a module with its plan entry, parameter and fused parameters,
and the helpers that list a module's tables by sharding type (torchrec's
``create_sharding_infos_by_sharding`` of ``embeddingbag`` and of ``embedding``).

A user-written sharded module hands each list to ``create_embedding_bag_sharding`` /
``create_embedding_sharding`` (``sharding_factory``) or to its own ``EmbeddingSharding``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from shardkit.modules.embedding_configs import (
    BaseEmbeddingConfig,
    EmbeddingTableConfig,
    PoolingType,
    embedding_names_by_table,
)
from shardkit.sharding.types import EmbeddingModuleShardingPlan, ParameterSharding
from shardkit.sharding.utils import add_params_from_parameter_sharding, merge_fused_params


@dataclasses.dataclass
class EmbeddingShardingInfo:
    """One table: its config (``EmbeddingTableConfig``, with ``embedding_names``), its plan entry, its
    full ``[num_embeddings, embedding_dim]`` parameter (possibly on the meta device) and its fused
    optimizer parameters (the sharder's merged with the plan's kernel options)."""

    embedding_config: EmbeddingTableConfig
    param_sharding: ParameterSharding
    param: torch.Tensor
    fused_params: Optional[Dict[str, Any]] = None


def _table_param(module: nn.Module, name: str, key: str) -> torch.Tensor:
    """Table ``name``'s full weight: ``module.table_weight(name)`` (shardkit's collections) or the
    parameter named ``key``; ``KeyError`` naming both when neither exists."""
    if hasattr(module, "table_weight"):
        return module.table_weight(name)
    params = dict(module.named_parameters())
    if key not in params:
        raise KeyError(f"create_sharding_infos_by_sharding: no parameter {key!r} for table {name!r}")
    return params[key]


def _infos_by_sharding(
    module: nn.Module,
    configs: List[BaseEmbeddingConfig],
    plan: EmbeddingModuleShardingPlan,
    key_of: Any,
    pooling_of: Any,
    fused_params: Optional[Dict[str, Any]],
) -> Dict[str, List[EmbeddingShardingInfo]]:
    names = [c.name for c in configs]
    missing = [n for n in names if n not in plan]
    unknown = [n for n in plan if n not in names]
    if missing or unknown:
        raise KeyError(
            f"create_sharding_infos_by_sharding: the plan lacks table(s) {missing} / names unknown table(s) "
            f"{unknown}; the module's tables: {names}"
        )
    weighted = bool(getattr(module, "is_weighted", lambda: False)())
    out: Dict[str, List[EmbeddingShardingInfo]] = {}
    for config, embedding_names in zip(configs, embedding_names_by_table(configs)):
        sharding = plan[config.name]
        table = EmbeddingTableConfig(
            num_embeddings=config.num_embeddings,
            embedding_dim=config.embedding_dim,
            name=config.name,
            data_type=config.data_type,
            feature_names=list(config.feature_names),
            weight_init_max=config.weight_init_max,
            weight_init_min=config.weight_init_min,
            init_fn=config.init_fn,
            pooling=pooling_of(config),
            is_weighted=weighted,
            embedding_names=embedding_names,
        )
        per_table = add_params_from_parameter_sharding(merge_fused_params(fused_params), sharding)
        info = EmbeddingShardingInfo(
            table, sharding, _table_param(module, config.name, key_of(config)), per_table
        )
        out.setdefault(sharding.sharding_type, []).append(info)
    return out


def create_sharding_infos_by_sharding(
    module: nn.Module,
    table_name_to_parameter_sharding: Dict[str, ParameterSharding],
    prefix: str,
    fused_params: Optional[Dict[str, Any]],
    suffix: Optional[str] = "weight",
) -> Dict[str, List[EmbeddingShardingInfo]]:
    """An EmbeddingBagCollection's tables (``module.embedding_bag_configs()``) as ``EmbeddingShardingInfo``
    lists by sharding type, in declaration order.

    Each table's parameter is ``module.table_weight(name)`` or else the parameter named
    ``f"{prefix}{name}.{suffix}"``; a feature of several tables is named ``feature@table`` in
    ``embedding_names``. ``KeyError`` when the plan and the module's tables differ."""
    return _infos_by_sharding(
        module,
        module.embedding_bag_configs(),
        table_name_to_parameter_sharding,
        lambda c: f"{prefix}{c.name}" + (f".{suffix}" if suffix else ""),
        lambda c: c.pooling,
        fused_params,
    )


def create_ec_sharding_infos_by_sharding(
    module: nn.Module,
    table_name_to_parameter_sharding: Dict[str, ParameterSharding],
    fused_params: Optional[Dict[str, Any]],
) -> Dict[str, List[EmbeddingShardingInfo]]:
    """An EmbeddingCollection's tables (``module.embedding_configs()``) as ``EmbeddingShardingInfo`` lists
    by sharding type (pooling NONE); the parameter is ``module.table_weight(name)`` or
    ``embeddings.<name>.weight``. torchrec's
    ``torchrec.distributed.embedding.create_sharding_infos_by_sharding``."""
    return _infos_by_sharding(
        module,
        module.embedding_configs(),
        table_name_to_parameter_sharding,
        lambda c: f"embeddings.{c.name}.weight",
        lambda c: PoolingType.NONE,
        fused_params,
    )


def replace_placement_with_meta_device(sharding_infos: List[EmbeddingShardingInfo]) -> None:
    """Point every shard placement of the infos' plans at the meta device (``rank:<r>/meta``), in
    place: a module built on the meta device is planned for a real device, and its shards must then
    be created on the meta device too."""
    for info in sharding_infos:
        spec = info.param_sharding.sharding_spec
        if spec is None:
            continue
        # ShardMetadata is frozen: the spec's list of shards is updated in place, as torchrec's is
        spec.shards[:] = [dataclasses.replace(s, placement=f"rank:{s.rank}/meta") for s in spec.shards]


__all__ = [
    "EmbeddingShardingInfo",
    "create_ec_sharding_infos_by_sharding",
    "create_sharding_infos_by_sharding",
    "replace_placement_with_meta_device",
]
