"""The extension interface of sharded embedding modules (torchrec's ``EmbeddingSharding`` and its parts).

A user-written sharded module in torchrec's style is built from one ``EmbeddingSharding`` per group of
tables, each of which creates three modules (docs/extension.md)::

    input_dist = sharding.create_input_dist()    # BaseSparseFeaturesDist: KJT -> Awaitable[Awaitable[KJT]]
    lookup = sharding.create_lookup()            # BaseEmbeddingLookup: KJT -> local embeddings
    output_dist = sharding.create_output_dist()  # BaseEmbeddingDist: (embeddings, ctx) -> Awaitable[...]

and a ``ModuleSharder`` whose ``shard`` returns the ``ShardedModule`` that chains them. shardkit's own
shardings are available through this interface from ``create_embedding_bag_sharding`` /
``create_embedding_sharding`` (``sharding_factory``); the interface itself holds no logic.

Type variables (torchrec's): C the sharding context, F the lookup's input (a KeyedJaggedTensor),
T the lookup's output, W what the output dist delivers.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, Generic, List, Optional, TypeVar, Union

import torch
from torch import nn

from shardkit.distributed.awaitable import Awaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.modules.feature_processor import BaseGroupedFeatureProcessor
from shardkit.sharding.sharded_embedding_table import ShardedEmbeddingTable
from shardkit.sharding.sharding_spec import ShardMetadata
from shardkit.sparse import KeyedJaggedTensor

C = TypeVar("C")
F = TypeVar("F")
T = TypeVar("T")
W = TypeVar("W")


class FeatureShardingMixIn:
    """The features of a sharding: their names (input order) and which rank looks each up."""

    def feature_names(self) -> List[str]:
        raise NotImplementedError(f"{type(self).__name__} does not implement feature_names()")

    def feature_names_per_rank(self) -> List[List[str]]:
        raise NotImplementedError(f"{type(self).__name__} does not implement feature_names_per_rank()")

    def features_per_rank(self) -> List[int]:
        raise NotImplementedError(f"{type(self).__name__} does not implement features_per_rank()")


class ModuleShardingMixIn:
    """A sharded module's shardings by name (e.g. sharding type -> ``EmbeddingSharding``)."""

    @property
    def shardings(self) -> Dict[str, FeatureShardingMixIn]:
        raise NotImplementedError(f"{type(self).__name__} does not implement shardings")


class BaseSparseFeaturesDist(abc.ABC, nn.Module, Generic[F]):
    """Moves sparse features from data parallel (this rank's samples, every feature) to model parallel
    (every rank's samples of the features this rank's shards look up).

    ``forward(sparse_features)`` returns ``Awaitable[Awaitable[F]]`` (the sizes' exchange, then the
    data's) or, for a dist with nothing to exchange, ``F`` itself."""

    @abc.abstractmethod
    def forward(self, sparse_features: KeyedJaggedTensor) -> Union[Awaitable[Awaitable[F]], F]:
        """Start the exchange of ``sparse_features``."""


class BaseEmbeddingDist(abc.ABC, nn.Module, Generic[C, T, W]):
    """Moves a lookup's output from model parallel back to data parallel (the ranks that own the samples).

    ``forward(local_embs, sharding_ctx)`` returns ``Awaitable[W]`` (or ``W``); ``sharding_ctx`` is what
    the input dist recorded for this sharding (e.g. ``EmbeddingShardingContext.batch_size_per_rank``)."""

    @abc.abstractmethod
    def forward(self, local_embs: T, sharding_ctx: Optional[C] = None) -> Union[Awaitable[W], W]:
        """Start sending ``local_embs`` back."""


class BaseEmbeddingLookup(abc.ABC, nn.Module, Generic[F, T]):
    """This rank's lookup of its shards: ``forward(sparse_features: F) -> T`` (pooled ``[rows, dims]``
    or one row per id)."""

    @abc.abstractmethod
    def forward(self, sparse_features: F) -> T:
        """Look up ``sparse_features`` in this rank's shards."""


class EmbeddingSharding(abc.ABC, Generic[C, F, T, W], FeatureShardingMixIn):
    """One way of sharding a group of tables: creates the input dist, the lookup and the output dist,
    and describes the embeddings it produces (names and dims in output order, per rank).

    Args:
        qcomm_codecs_registry: ``CommOp`` value -> ``QuantizedCommCodecs`` for its dists.
    """

    def __init__(self, qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None) -> None:
        self._qcomm_codecs_registry = qcomm_codecs_registry

    @property
    def qcomm_codecs_registry(self) -> Optional[Dict[str, QuantizedCommCodecs]]:
        return self._qcomm_codecs_registry

    @abc.abstractmethod
    def create_input_dist(self, device: Optional[torch.device] = None) -> BaseSparseFeaturesDist[F]:
        """The module that sends the features of this sharding's tables to their ranks."""

    @abc.abstractmethod
    def create_output_dist(self, device: Optional[torch.device] = None) -> BaseEmbeddingDist[C, T, W]:
        """The module that sends the looked-up embeddings back to the samples' ranks."""

    @abc.abstractmethod
    def create_lookup(
        self,
        device: Optional[torch.device] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        feature_processor: Optional[BaseGroupedFeatureProcessor] = None,
    ) -> BaseEmbeddingLookup[F, T]:
        """This rank's lookup module (holds this rank's shards)."""

    @abc.abstractmethod
    def embedding_dims(self) -> List[int]:
        """The width of each output embedding, in output order."""

    @abc.abstractmethod
    def embedding_shard_metadata(self) -> List[Optional[ShardMetadata]]:
        """Each output embedding's shard (None where the table is not split)."""

    @abc.abstractmethod
    def embedding_names(self) -> List[str]:
        """The name of each output embedding, in output order."""

    @abc.abstractmethod
    def embedding_names_per_rank(self) -> List[List[str]]:
        """The output embeddings each rank's lookup computes."""

    def embedding_tables(self) -> List[ShardedEmbeddingTable]:
        raise NotImplementedError(f"{type(self).__name__} does not implement embedding_tables()")

    def uncombined_embedding_dims(self) -> List[int]:
        return self.embedding_dims()

    def uncombined_embedding_names(self) -> List[str]:
        return self.embedding_names()


__all__ = [
    "BaseEmbeddingDist",
    "BaseEmbeddingLookup",
    "BaseSparseFeaturesDist",
    "EmbeddingSharding",
    "FeatureShardingMixIn",
    "ModuleShardingMixIn",
]
