"""What the sharded MC-EBC and MC-EC share: the sharded MC collection in front of the sharded embedding
module, evicted rows reset on whichever rank holds them (the specification's ``mc_embedding_modules``).

forward(features) -> ``(embeddings, remapped KJT or None)``, embeddings as the sharded embedding
module's (a ``LazyAwaitable``):

- ``input_dist``: the MC collection's (ids to the owners of their buckets);
- ``compute``: remap on the owners, slots back to the samples' ranks with the evictions; every rank
  re-initializes the evicted rows (and their fused optimizer state) of the shards it holds; then the
  embedding module's own input dist of the remapped ids and its lookup;
- ``output_dist``: the embedding module's.

The remapped ids return to the samples' ranks before the embedding module's input dist sends them to
the rows' owners: one more all-to-all of ids than torchrec, which looks them up on the owner directly
(row-wise only), and what lets TABLE_WISE and COLUMN_WISE tables work the same way.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple, Type, Union

import torch

from shardkit.distributed.awaitable import Awaitable, LazyAwaitable
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from shardkit.modules.mc_row_reset import reset_rows_
from shardkit.sharding.kjt_list import KJTList
from shardkit.sharding.mc_modules import (
    ManagedCollisionCollectionContext,
    ManagedCollisionCollectionSharder,
    ShardedManagedCollisionCollection,
)
from shardkit.sharding.sharded_embedding_module import ShardedEmbeddingModule
from shardkit.sharding.types import EmbeddingModuleShardingPlan, ModuleSharder, ShardedModule
from shardkit.sparse import KeyedJaggedTensor

MCModule = Union[ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection]


class BaseManagedCollisionContext(ManagedCollisionCollectionContext):
    """The MC collection's context plus ``evictions_per_table``, ``remapped_kjt`` (a one-element
    KJTList) and the embedding module's own context."""

    def __init__(self) -> None:
        super().__init__()
        self.remapped_kjt: Optional[KJTList] = None
        self.embedding_context: Any = None

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        if self.remapped_kjt is not None:
            self.remapped_kjt.record_stream(stream)
        if self.embedding_context is not None:
            self.embedding_context.record_stream(stream)


class BaseShardedManagedCollisionEmbeddingCollection(ShardedModule):
    """See the module docstring. State dict: the unsharded module's keys
    (``_embedding_module.<embedding_bags|embeddings>.<table>.weight``,
    ``_managed_collision_collection._managed_collision_modules.<table>.<buffer>``)."""

    context_type: Type[BaseManagedCollisionContext] = BaseManagedCollisionContext

    def __init__(
        self,
        module: MCModule,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        e_sharder: ModuleSharder,
        mc_sharder: ManagedCollisionCollectionSharder,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self._env = env
        self._embedding_module: ShardedEmbeddingModule = e_sharder.shard(
            module._embedding_module, table_name_to_parameter_sharding, env, device
        )
        self._managed_collision_collection: ShardedManagedCollisionCollection = mc_sharder.shard(
            module._managed_collision_collection, table_name_to_parameter_sharding, env, device=device
        )
        self._return_remapped_features = module._return_remapped_features
        self._allow_in_place_embed_weight_update = module._allow_in_place_embed_weight_update
        self.evictions_per_table: Dict[str, Optional[torch.Tensor]] = {}

    @property
    def fused_optimizer(self):
        return self._embedding_module.fused_optimizer

    def create_context(self) -> BaseManagedCollisionContext:
        return self.context_type()

    def input_dist(
        self, ctx: BaseManagedCollisionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        return self._managed_collision_collection.input_dist(ctx, features)

    def _remap_and_reset(self, ctx: BaseManagedCollisionContext, dist_input: KJTList) -> KeyedJaggedTensor:
        mcc = self._managed_collision_collection
        remapped = mcc.output_dist(ctx, mcc.compute(ctx, dist_input)).wait()
        self.evictions_per_table = ctx.evictions_per_table
        for table, slots in ctx.evictions_per_table.items():
            if slots is None:
                continue
            for sharded_lookup in self._embedding_module.lookups:
                for lookup in sharded_lookup.lookups:
                    reset_rows_(lookup, table, slots, mcc.iteration(table))
        ctx.remapped_kjt = KJTList([remapped])
        ctx.embedding_context = self._embedding_module.create_context()
        return remapped

    def compute(self, ctx: BaseManagedCollisionContext, dist_input: KJTList) -> List[torch.Tensor]:
        remapped = self._remap_and_reset(ctx, dist_input)
        inner = self._embedding_module.input_dist(ctx.embedding_context, remapped).wait().wait()
        return self._embedding_module.compute(ctx.embedding_context, inner)

    def output_dist(
        self, ctx: BaseManagedCollisionContext, output: List[torch.Tensor]
    ) -> Tuple[LazyAwaitable, Optional[KeyedJaggedTensor]]:
        embeddings = self._embedding_module.output_dist(ctx.embedding_context, output)
        return embeddings, self._remapped(ctx)

    def compute_and_output_dist(
        self, ctx: BaseManagedCollisionContext, input: KJTList
    ) -> Tuple[LazyAwaitable, Optional[KeyedJaggedTensor]]:
        remapped = self._remap_and_reset(ctx, input)
        inner = self._embedding_module.input_dist(ctx.embedding_context, remapped).wait().wait()
        embeddings = self._embedding_module.compute_and_output_dist(ctx.embedding_context, inner)
        return embeddings, self._remapped(ctx)

    def _remapped(self, ctx: BaseManagedCollisionContext) -> Optional[KeyedJaggedTensor]:
        return ctx.remapped_kjt[0] if self._return_remapped_features else None

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        inner = f"{prefix}{'.' if prefix else ''}_embedding_module"
        return self._embedding_module.sharded_parameter_names(inner)


class BaseManagedCollisionEmbeddingCollectionSharder(ModuleSharder):
    """Shards an MC module with its embedding module's sharder and the MC collection's sharder; the
    sharding types are those both support (ROW_WISE, TABLE_WISE, COLUMN_WISE)."""

    sharded_type: Type[BaseShardedManagedCollisionEmbeddingCollection] = (
        BaseShardedManagedCollisionEmbeddingCollection
    )

    def __init__(
        self,
        e_sharder: ModuleSharder,
        mc_sharder: Optional[ManagedCollisionCollectionSharder] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        self._e_sharder = e_sharder
        self._mc_sharder = mc_sharder or ManagedCollisionCollectionSharder()

    def shard(
        self,
        module: MCModule,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> BaseShardedManagedCollisionEmbeddingCollection:
        return self.sharded_type(module, params, self._e_sharder, self._mc_sharder, env, device)

    def shardable_parameters(self, module: MCModule) -> Dict[str, torch.Tensor]:
        return self._e_sharder.shardable_parameters(module._embedding_module)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        mc = self._mc_sharder.sharding_types(compute_device_type)
        return [t for t in self._e_sharder.sharding_types(compute_device_type) if t in mc]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return self._e_sharder.compute_kernels(sharding_type, compute_device_type)

    @property
    def fused_params(self) -> Optional[Dict[str, Any]]:
        return getattr(self._e_sharder, "fused_params", None)


__all__ = [
    "BaseManagedCollisionContext",
    "BaseManagedCollisionEmbeddingCollectionSharder",
    "BaseShardedManagedCollisionEmbeddingCollection",
]
