"""ShardedEmbeddingCollection and its sharder (the specification's ``embedding``): sequence embeddings."""

from __future__ import annotations

from typing import Dict, List, Optional, Type

import torch

from shardkit.distributed.awaitable import Awaitable, LazyAwaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingCollection, FusedOptimizerConfig
from shardkit.sharding.column_wise import CwSequenceEmbeddingSharding
from shardkit.sharding.data_parallel import DpSequenceEmbeddingSharding
from shardkit.sharding.ec_index_dedup import expand_rows, get_ec_index_dedup
from shardkit.sharding.embedding_sharder import BaseEmbeddingSharder
from shardkit.sharding.fused_optimizer_config import resolve_fused_optimizer
from shardkit.sharding.kjt_list import KJTList
from shardkit.sharding.row_wise import RwSequenceEmbeddingSharding
from shardkit.sharding.sharded_embedding_module import (
    EmbeddingModuleContext,
    ShardedEmbeddingModule,
)
from shardkit.sharding.table_column_wise import TwCwSequenceEmbeddingSharding
from shardkit.sharding.table_row_wise import TwRwSequenceEmbeddingSharding
from shardkit.sharding.table_wise import TwSequenceEmbeddingSharding
from shardkit.sharding.types import (
    EmbeddingModuleShardingPlan,
    ShardingType,
)
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor

SEQUENCE_SHARDINGS = {
    ShardingType.DATA_PARALLEL.value: DpSequenceEmbeddingSharding,
    ShardingType.TABLE_WISE.value: TwSequenceEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: CwSequenceEmbeddingSharding,
    ShardingType.ROW_WISE.value: RwSequenceEmbeddingSharding,
    ShardingType.TABLE_ROW_WISE.value: TwRwSequenceEmbeddingSharding,
    ShardingType.TABLE_COLUMN_WISE.value: TwCwSequenceEmbeddingSharding,
}


class _SequenceOutputAwaitable(LazyAwaitable[Dict[str, JaggedTensor]]):
    """Waits each sharding's output dist; builds ``{feature: JaggedTensor}`` in declaration order."""

    def __init__(
        self,
        parts: List[Awaitable],
        features: KeyedJaggedTensor,
        names: List[str],
        need_indices: bool,
        source_feature: Dict[str, str],
        index_dedup: Optional[Dict[str, torch.Tensor]] = None,
    ):
        super().__init__()
        self._parts, self._features, self._names, self._need_indices = parts, features, names, need_indices
        self._source, self._index_dedup = source_feature, index_dedup

    def _wait_impl(self) -> Dict[str, JaggedTensor]:
        rows: Dict[str, torch.Tensor] = {}
        for aw in self._parts:
            rows.update(aw.wait())
        if self._index_dedup is not None:  # rows of distinct ids -> a row per id of the input
            rows = {name: expand_rows(r, self._index_dedup[name]) for name, r in rows.items()}
        out = {}
        for name in self._names:
            jt = self._features[self._source[name]]
            ids = jt.values() if self._need_indices else None
            out[name] = JaggedTensor(rows[name], ids, lengths=jt.lengths(), validate=False)
        return out


class ShardedEmbeddingCollection(ShardedEmbeddingModule):
    """An EmbeddingCollection whose tables are placed by a plan.

    forward(features: KeyedJaggedTensor of this rank's batch, all features) ->
    ``LazyAwaitable[Dict[str, JaggedTensor]]``: per feature in declaration order, values
    ``[ids of this rank's feature, embedding_dim]`` (lengths as in the input; with ``need_indices`` the
    ids as weights), equal to the unsharded module's. Tables are copied from ``module``.
    ``state_dict()`` keys are the unsharded module's, ``embeddings.<table>.weight``.
    """

    table_key = "embeddings"
    sharding_classes = SEQUENCE_SHARDINGS  # the quantized collection brings its own

    def __init__(
        self,
        module: EmbeddingCollection,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        fused_optimizer: Optional[FusedOptimizerConfig] = None,
    ) -> None:
        on_meta = any(p.device.type == "meta" for p in module.parameters())
        super().__init__(
            module.embedding_configs(),
            table_name_to_parameter_sharding,
            env,
            False,
            self.sharding_classes,
            fused_optimizer or resolve_fused_optimizer(module, None),
            None if on_meta else module.table_weight,
            device,
            qcomm_codecs_registry,
        )
        self._names = [f for t in self._tables for f in t.config.feature_names]  # feature@table if shared
        self._need_indices = module.need_indices()
        # torchrec reads the switch when the module is sharded (set_ec_index_dedup)
        self._index_dedup = get_ec_index_dedup()

    def input_dist(
        self, ctx: EmbeddingModuleContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        ctx.features = features  # the output keeps the input's lengths (and ids, with need_indices)
        return super().input_dist(ctx, features)

    def compute(self, ctx: EmbeddingModuleContext, dist_input: KJTList) -> List[torch.Tensor]:
        return [
            s.compute(c, lk, kjt)
            for s, c, lk, kjt in zip(self._shardings, ctx.sharding_contexts, self.lookups, dist_input)
        ]

    def output_dist(
        self, ctx: EmbeddingModuleContext, output: List[torch.Tensor]
    ) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        parts = [s.output_dist(c, out) for s, c, out in zip(self._shardings, ctx.sharding_contexts, output)]
        return _SequenceOutputAwaitable(
            parts, ctx.features, self._names, self._need_indices, self._source_feature, ctx.index_dedup
        )

    def compute_and_output_dist(
        self, ctx: EmbeddingModuleContext, input: KJTList
    ) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        return _SequenceOutputAwaitable(
            self._compute_and_start(ctx, input),
            ctx.features,
            self._names,
            self._need_indices,
            self._source_feature,
            ctx.index_dedup,
        )


class EmbeddingCollectionSharder(BaseEmbeddingSharder[EmbeddingCollection]):
    """Shards an EmbeddingCollection: every sharding type; FUSED or DENSE kernels (DENSE only for
    data-parallel tables)."""

    @property
    def module_type(self) -> Type[EmbeddingCollection]:
        return EmbeddingCollection

    def shard(
        self,
        module: EmbeddingCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedEmbeddingCollection:
        return ShardedEmbeddingCollection(
            module,
            self.plan_with_cache_params(params),
            env,
            device,
            self.qcomm_codecs_registry,
            self.fused_optimizer_for(module),
        )

    def shardable_parameters(self, module: EmbeddingCollection) -> Dict[str, torch.Tensor]:
        return {t.name: module.table_weight(t.name) for t in module.embedding_configs()}


__all__ = ["EmbeddingCollectionSharder", "ShardedEmbeddingCollection"]
