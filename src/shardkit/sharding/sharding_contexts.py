"""The per-forward contexts of torchrec-style sharded modules (what the input dist records for the
output dist).

- ``EmbeddingShardingContext``: one sharding's batch sizes (``batch_size_per_rank``: every rank's
  batch, in rank order; with a variable batch per feature, per rank per feature);
- ``SequenceShardingContext``: plus what a sequence (unpooled) output dist needs: the KJT all-to-all's
  splits of the ids and its reordering (``sparse_features_recat``), the row-wise unbucketize permute and
  the lengths after the input dist;
- ``EmbeddingBagCollectionContext`` / ``EmbeddingCollectionContext``: one context per sharding of a
  module, plus the module's inverse / reverse indices.

``KJTListSplitsAwaitable`` / ``KJTListAwaitable`` fill the sharding contexts from the KJT all-to-alls.
``dist_context`` (not an argument) is shardkit's: the context a built-in sharding's input dist filled
for its output dist (``sharding_factory``); it stays None for a user's own dists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from shardkit.distributed.multistreamable import Multistreamable
from shardkit.sparse import KeyedJaggedTensor


def _record(tensor: Optional[torch.Tensor], stream: torch.Stream) -> None:
    if tensor is not None:
        tensor.record_stream(stream)


@dataclass
class EmbeddingShardingContext(Multistreamable):
    """One sharding's batch sizes in one forward (see the module docstring)."""

    batch_size_per_rank: List[int] = field(default_factory=list)
    batch_size_per_rank_per_feature: List[List[int]] = field(default_factory=list)
    batch_size_per_feature_pre_a2a: List[int] = field(default_factory=list)
    variable_batch_per_feature: bool = False
    dist_context: Optional[Any] = field(default=None, init=False, repr=False, compare=False)

    def record_stream(self, stream: torch.Stream) -> None:
        if hasattr(self.dist_context, "record_stream"):
            self.dist_context.record_stream(stream)


@dataclass
class SequenceShardingContext(EmbeddingShardingContext):
    """A sequence sharding's context: ``features_before_input_dist`` (this rank's input KJT),
    ``input_splits`` / ``output_splits`` (ids sent to / received from each rank), ``sparse_features_recat``
    (the all-to-all's reordering of received segments), ``unbucketize_permute_tensor`` (row-wise: ids
    back in input order), ``lengths_after_input_dist`` (``[features, batch]`` lengths looked up here)."""

    features_before_input_dist: Optional[KeyedJaggedTensor] = None
    input_splits: List[int] = field(default_factory=list)
    output_splits: List[int] = field(default_factory=list)
    sparse_features_recat: Optional[torch.Tensor] = None
    unbucketize_permute_tensor: Optional[torch.Tensor] = None
    lengths_after_input_dist: Optional[torch.Tensor] = None

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        if self.features_before_input_dist is not None:
            self.features_before_input_dist.record_stream(stream)
        for tensor in (
            self.sparse_features_recat,
            self.unbucketize_permute_tensor,
            self.lengths_after_input_dist,
        ):
            _record(tensor, stream)


@dataclass
class EmbeddingBagCollectionContext(Multistreamable):
    """A pooled module's context: one ``EmbeddingShardingContext`` per sharding (None for a sharding
    that needs none), the input's ``inverse_indices`` (keys, ``[F, B]``) with a variable batch per
    feature, and whether the batch varies per feature."""

    sharding_contexts: List[Optional[EmbeddingShardingContext]] = field(default_factory=list)
    inverse_indices: Optional[Tuple[List[str], torch.Tensor]] = None
    variable_batch_per_feature: bool = False

    def record_stream(self, stream: torch.Stream) -> None:
        for ctx in self.sharding_contexts:
            if ctx is not None:
                ctx.record_stream(stream)
        if self.inverse_indices is not None:
            self.inverse_indices[1].record_stream(stream)


@dataclass
class EmbeddingCollectionContext(Multistreamable):
    """A sequence module's context: one ``SequenceShardingContext`` per sharding, the input features of
    each sharding (``input_features``) and, with index deduplication, the ``reverse_indices`` that expand
    each sharding's deduplicated ids back to the input's."""

    sharding_contexts: List[SequenceShardingContext] = field(default_factory=list)
    input_features: List[KeyedJaggedTensor] = field(default_factory=list)
    reverse_indices: List[torch.Tensor] = field(default_factory=list)

    def record_stream(self, stream: torch.Stream) -> None:
        for ctx in self.sharding_contexts:
            ctx.record_stream(stream)
        for features in self.input_features:
            features.record_stream(stream)
        for tensor in self.reverse_indices:
            tensor.record_stream(stream)


__all__ = [
    "EmbeddingBagCollectionContext",
    "EmbeddingCollectionContext",
    "EmbeddingShardingContext",
    "SequenceShardingContext",
]
