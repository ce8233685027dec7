"""Sharded FeatureProcessedEmbeddingBagCollection: position-weighted features on any sharding type.

A position weight depends on where an id sits in its bag, which row-wise bucketization changes (a
rank receives only part of each bag). So before the input dist each id of a processed feature gets
its *position* as its KJT weight (float32, exact below 2^24); the positions travel with the ids, and
on the rank that looks the id up the processor's ``position_weight[position]`` becomes the weight.
Features without a processor keep their input weights (1 when the input has none), as unsharded.

Gradients: each rank's ``position_weight.grad`` holds the part of the gradient that comes from the
ids its shards looked up (which already carries the output dists' gradient division); the *sum* over
ranks (an all-reduce SUM, not DDP's mean) is the gradient of the unsharded module on the global batch
(divided by the world size while ``get_gradient_division()``, like the tables' gradients).
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Type

import torch
from torch import nn

from shardkit.distributed.awaitable import LazyAwaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.comm_ops import get_gradient_division
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.kernels import bag_of_each_id
from shardkit.modules import (
    FeatureProcessedEmbeddingBagCollection,
    FusedOptimizerConfig,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from shardkit.sharding.data_parallel import DpPooledEmbeddingSharding
from shardkit.sharding.embedding_sharding import CommOpGradientScaling, EmbeddingShardingImpl, with_weights
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from shardkit.sharding.kjt_list import KJTList
from shardkit.sharding.sharded_embedding_module import EmbeddingModuleContext
from shardkit.sharding.types import EmbeddingModuleShardingPlan
from shardkit.sparse import KeyedJaggedTensor, KeyedTensor


class ShardedFeatureProcessedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """A FeatureProcessedEmbeddingBagCollection whose tables are placed by a plan.

    Args:
        module: the unsharded module; its processors must be ``{feature: PositionWeightedModule}`` or
            a ``PositionWeightedModuleCollection`` (copied, so the sharded module owns its parameters).
        table_name_to_parameter_sharding, env, device, qcomm_codecs_registry: as for
            ``ShardedEmbeddingBagCollection``.

    forward(features) -> ``LazyAwaitable[KeyedTensor]``, as the unsharded module's on this rank's samples.
    A bag longer than a processor's ``max_feature_length`` raises ``ValueError`` on every rank.
    ``state_dict()`` keys are the unsharded module's:
    ``_embedding_bag_collection.embedding_bags.<table>.weight`` (sharded values) and
    ``_feature_processors.<feature>.position_weight`` or ``_feature_processors.position_weights.<feature>``
    (replicated, plain tensors).
    """

    table_key = "_embedding_bag_collection.embedding_bags"

    def __init__(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        table_name_to_parameter_sharding: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        fused_optimizer: Optional[FusedOptimizerConfig] = None,
    ) -> None:
        processors = module._feature_processors
        if isinstance(processors, nn.ModuleDict):
            unsupported = [f for f, p in processors.items() if not isinstance(p, PositionWeightedModule)]
            if unsupported:
                raise TypeError(
                    f"features {unsupported}: only PositionWeightedModule processors can be sharded"
                )
        elif not isinstance(processors, PositionWeightedModuleCollection):
            raise TypeError(
                f"{type(processors).__name__}: only PositionWeightedModule processors (a dict of them or a "
                "PositionWeightedModuleCollection) can be sharded"
            )
        super().__init__(
            module.embedding_bag_collection,
            table_name_to_parameter_sharding,
            env,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            # only when given: the quantized subclass's next base (inference) takes no optimizer
            **({} if fused_optimizer is None else {"fused_optimizer": fused_optimizer}),
        )
        # a replica under the unsharded module's attribute name, so that state-dict keys match
        self._feature_processors = copy.deepcopy(processors)
        if isinstance(processors, nn.ModuleDict):
            self._max_lengths = {f: p.max_feature_length for f, p in processors.items()}
        else:
            self._max_lengths = dict(processors.max_feature_lengths)
        # a collection weighs the features it does not process by 1; a dict keeps their input weights
        self._others_weigh_one = not isinstance(processors, nn.ModuleDict)
        self._extra_input_check = self._check_bag_lengths

    @property
    def feature_processors(self) -> nn.Module:
        """The processors (a replica on every rank): ``{feature: PositionWeightedModule}`` or a
        ``PositionWeightedModuleCollection``, as the unsharded module's."""
        return self._feature_processors

    def _position_weight(self, feature: str) -> torch.Tensor:
        """``[max length]``: feature ``feature``'s weight of each position."""
        processors = self._feature_processors
        if isinstance(processors, nn.ModuleDict):
            return processors[feature].position_weight
        return processors.position_weights[feature]

    def _check_bag_lengths(self, features: KeyedJaggedTensor) -> None:
        for key, jt in features.to_dict().items():
            if key in self._max_lengths and jt.lengths().numel():
                longest, limit = int(jt.lengths().max()), self._max_lengths[key]
                if longest > limit:
                    raise ValueError(
                        f"feature {key!r}: a bag has {longest} ids, more than max_feature_length {limit}"
                    )

    def input_dist(self, ctx: EmbeddingModuleContext, features: KeyedJaggedTensor):
        return super().input_dist(ctx, self._positions_as_weights(features))

    def _positions_as_weights(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Processed features' weights := each id's position in its bag; others keep theirs (or 1)."""
        values = features.values()
        offsets = features.offsets().to(torch.int64)
        positions = torch.arange(values.numel(), device=values.device) - offsets.index_select(
            0, bag_of_each_id(offsets, values.numel())
        )
        original = features.weights_or_none()
        counts = features.length_per_key()
        pieces = []
        for key, pos, old in zip(
            features.keys(),
            positions.split(counts),
            original.split(counts) if original is not None else [None] * len(counts),
        ):
            if key in self._max_lengths:
                pieces.append(pos.to(torch.float32))
            elif self._others_weigh_one:
                pieces.append(torch.ones_like(pos, dtype=torch.float32))
            else:
                pieces.append(
                    old.to(torch.float32) if old is not None else torch.ones_like(pos, dtype=torch.float32)
                )
        weights = torch.cat(pieces) if pieces else torch.zeros(0, device=values.device)
        return with_weights(features, weights)

    def _weigh(self, sharding: EmbeddingShardingImpl, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Received positions -> position weights, for the processed features ``sharding`` looks up."""
        features = [self._source_feature[f] for f in sharding.received_features()]  # the input's names
        if not any(f in self._max_lengths for f in features):
            return kjt
        # a data-parallel lookup has no output dist to divide its gradient by the world size, as the
        # other shardings' dists do; dividing here gives every position weight the same convention
        scale = 1.0
        if isinstance(sharding, DpPooledEmbeddingSharding) and get_gradient_division():
            scale = 1.0 / sharding.world_size
        received = kjt.weights()
        pieces = []
        for feature, piece in zip(features, received.split(kjt.length_per_key())):
            if feature in self._max_lengths:
                table = self._position_weight(feature)
                if scale != 1.0:
                    table = CommOpGradientScaling.apply(table, scale)
                piece = table.index_select(0, piece.to(torch.int64)).to(torch.float32)
            pieces.append(piece)
        weights = torch.cat(pieces)
        if received.requires_grad:
            # the received weights' backward is an all-to-all: keep them in this rank's graph even
            # where positions replace them all, or the ranks that use theirs would wait for this one
            weights = weights + received * 0
        return with_weights(kjt, weights)

    def compute(self, ctx: EmbeddingModuleContext, dist_input: KJTList) -> List[torch.Tensor]:
        return super().compute(ctx, self._weigh_all(dist_input))

    def compute_and_output_dist(
        self, ctx: EmbeddingModuleContext, input: KJTList
    ) -> LazyAwaitable[KeyedTensor]:
        return super().compute_and_output_dist(ctx, self._weigh_all(input))

    def _weigh_all(self, dist_input: KJTList) -> KJTList:
        return KJTList([self._weigh(s, kjt) for s, kjt in zip(self._shardings, dist_input)])


class FeatureProcessedEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Shards a FeatureProcessedEmbeddingBagCollection (every sharding type; see the module doc)."""

    @property
    def module_type(self) -> Type[FeatureProcessedEmbeddingBagCollection]:
        return FeatureProcessedEmbeddingBagCollection

    def shard(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedFeatureProcessedEmbeddingBagCollection:
        return ShardedFeatureProcessedEmbeddingBagCollection(
            module,
            self.plan_with_cache_params(params),
            env,
            device,
            self.qcomm_codecs_registry,
            self.fused_optimizer_for(module.embedding_bag_collection),
        )

    def shardable_parameters(self, module: FeatureProcessedEmbeddingBagCollection) -> Dict[str, torch.Tensor]:
        return super().shardable_parameters(module.embedding_bag_collection)


__all__ = ["FeatureProcessedEmbeddingBagCollectionSharder", "ShardedFeatureProcessedEmbeddingBagCollection"]
