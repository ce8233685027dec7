"""A stand-in sharder for the planner tests: it shards nothing, it only declares what it supports.

The real EmbeddingBagCollection sharder lives in shardkit.sharding; the planner only needs a sharder's
``module_type``, ``sharding_types`` and ``compute_kernels``.
"""

from __future__ import annotations

import random
from typing import List, Optional, Sequence

import torch

from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    FusedOptimizerConfig,
    OptimType,
)
from shardkit.sharding.types import EmbeddingComputeKernel, ModuleSharder, ShardingType

ALL_TYPES = [t.value for t in ShardingType]
FUSED = EmbeddingComputeKernel.FUSED.value
DENSE = EmbeddingComputeKernel.DENSE.value


class PlanOnlySharder(ModuleSharder):
    """Declares ``types`` and ``kernels`` for ``module_type``; ``shard`` is not part of planning."""

    def __init__(
        self,
        module_type: type = EmbeddingBagCollection,
        types: Optional[Sequence[str]] = None,
        kernels: Optional[Sequence[str]] = None,
    ) -> None:
        super().__init__()
        self._module_type = module_type
        self._types = list(types or ALL_TYPES)
        self._kernels = list(kernels or [FUSED, DENSE])

    @property
    def module_type(self) -> type:
        return self._module_type

    def shard(self, module, params, env, device=None):
        raise NotImplementedError("the planner tests never shard")

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(self._types)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return list(self._kernels)


def ebc_sharder(**kwargs) -> PlanOnlySharder:
    return PlanOnlySharder(EmbeddingBagCollection, **kwargs)


def ec_sharder(**kwargs) -> PlanOnlySharder:
    return PlanOnlySharder(EmbeddingCollection, **kwargs)


def random_tables(n: int, seed: int, max_rows: int = 10**6) -> List[EmbeddingBagConfig]:
    """``n`` tables of mixed sizes (rows from 10 to ``max_rows``, dims 8 to 256)."""
    rng = random.Random(seed)
    rows = [r for r in (10, 1000, 10**4, 10**5, 10**6) if r <= max_rows]
    return [
        EmbeddingBagConfig(
            num_embeddings=rng.choice(rows) + rng.randrange(7),
            embedding_dim=rng.choice([8, 16, 64, 128, 256]),
            name=f"t{i}",
            feature_names=[f"f{i}"],
        )
        for i in range(n)
    ]


def meta_ebc(tables, fused: bool = True, **kwargs) -> EmbeddingBagCollection:
    """An EBC whose tables take no memory (the planner only reads configs), with a fused SGD
    optimizer unless ``fused`` is False (without one, the FUSED kernels are not an option)."""
    optimizer = FusedOptimizerConfig(OptimType.SGD) if fused else None
    return EmbeddingBagCollection(tables, device=torch.device("meta"), fused_optimizer=optimizer, **kwargs)


def meta_ec(tables) -> EmbeddingCollection:
    """An EmbeddingCollection on the meta device with a fused SGD optimizer."""
    return EmbeddingCollection(
        tables, device=torch.device("meta"), fused_optimizer=FusedOptimizerConfig(OptimType.SGD)
    )
