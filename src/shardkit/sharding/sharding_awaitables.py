"""The awaitables a torchrec-style sharded module chains its dists with.

Input side: ``KJTListSplitsAwaitable`` (phase one of every sharding's KJT all-to-all: the sizes) ->
``KJTListAwaitable`` (phase two: the data) -> ``KJTList``. On the way they record into the module
context's ``sharding_contexts[i]`` what output dist ``i`` needs: ``batch_size_per_rank`` (every rank's
batch), a sequence context's ``input_splits`` / ``output_splits`` / ``sparse_features_recat``, with a
variable batch per feature ``batch_size_per_rank_per_feature``; for shardkit's built-in shardings the
whole context their input dist filled (``dist_context``).

Output side: ``EmbeddingBagCollectionAwaitable`` (pooled shardings' outputs -> one ``KeyedTensor``,
``construct_output_kt``) and ``EmbeddingCollectionAwaitable`` (sequence outputs -> one
``JaggedTensor`` per embedding name).
"""

from __future__ import annotations

from typing import Any, Dict, Generic, List, Optional, TypeVar

import torch

from shardkit.distributed.awaitable import Awaitable, LazyAwaitable
from shardkit.sharding.kjt_list import KJTList, ListOfKJTList
from shardkit.sharding.sharding_contexts import (
    EmbeddingCollectionContext,
    EmbeddingShardingContext,
    SequenceShardingContext,
)
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

C = TypeVar("C")


def _sharding_contexts(ctx: Any) -> List[Any]:
    return list(getattr(ctx, "sharding_contexts", None) or [])


def _record_intra_a2a(tensors_awaitables: List[Awaitable[KeyedJaggedTensor]], ctx: Any) -> None:
    """After the sizes' exchange: each sharding context gets its dist's batch sizes and splits."""
    for awaitable, sharding_ctx in zip(tensors_awaitables, _sharding_contexts(ctx)):
        if sharding_ctx is None:
            continue
        dist_context = getattr(awaitable, "dist_context", None)
        if dist_context is not None and hasattr(sharding_ctx, "dist_context"):
            sharding_ctx.dist_context = dist_context
        source = dist_context if dist_context is not None else awaitable
        stride_per_rank = getattr(source, "stride_per_rank", None)
        if stride_per_rank is not None and isinstance(sharding_ctx, EmbeddingShardingContext):
            sharding_ctx.batch_size_per_rank = list(stride_per_rank)
        if isinstance(sharding_ctx, SequenceShardingContext):
            splits_in, splits_out = (
                getattr(source, "input_splits", None),
                getattr(source, "output_splits", None),
            )
            # a KJT all-to-all keys its splits by tensor; a built-in sharding's context holds the ids'
            if isinstance(splits_in, dict):
                splits_in, splits_out = splits_in["values"], splits_out["values"]
            if splits_in is not None:
                sharding_ctx.input_splits, sharding_ctx.output_splits = list(splits_in), list(splits_out)
            if dist_context is None and hasattr(awaitable, "recat"):
                sharding_ctx.sparse_features_recat = awaitable.recat


def _record_post_a2a(kjts: List[KeyedJaggedTensor], ctx: Any) -> None:
    """After the data's exchange: per-rank per-feature batch sizes of a variable batch per feature, and
    a built-in sequence sharding's reordering of the received segments."""
    for kjt, sharding_ctx in zip(kjts, _sharding_contexts(ctx)):
        if sharding_ctx is None:
            continue
        if isinstance(sharding_ctx, EmbeddingShardingContext) and kjt.variable_stride_per_key():
            per_key_per_rank = kjt.stride_per_key_per_rank()  # [keys][ranks]
            if per_key_per_rank:
                sharding_ctx.batch_size_per_rank_per_feature = [list(r) for r in zip(*per_key_per_rank)]
        dist_context = getattr(sharding_ctx, "dist_context", None)
        if isinstance(sharding_ctx, SequenceShardingContext) and dist_context is not None:
            sharding_ctx.sparse_features_recat = getattr(dist_context, "recat", None)
            sharding_ctx.unbucketize_permute_tensor = getattr(dist_context, "unbucketize", None)


class KJTListAwaitable(Awaitable[KJTList]):
    """Phase two of every sharding's input dist: ``wait()`` -> ``KJTList`` (one KJT per sharding).

    Args:
        awaitables: each sharding's ``Awaitable[KeyedJaggedTensor]``.
        ctx: the module context whose ``sharding_contexts`` (same order) record the batch sizes.
    """

    def __init__(self, awaitables: List[Awaitable[KeyedJaggedTensor]], ctx: Any) -> None:
        super().__init__()
        self.awaitables = list(awaitables)
        self.ctx = ctx

    def _wait_impl(self) -> KJTList:
        kjts = [w.wait() for w in self.awaitables]
        _record_post_a2a(kjts, self.ctx)
        return KJTList(kjts)


class KJTListSplitsAwaitable(Awaitable[Awaitable[KJTList]], Generic[C]):
    """Phase one of every sharding's input dist: ``wait()`` -> ``KJTListAwaitable``.

    Args:
        awaitables: each sharding's input dist result, ``Awaitable[Awaitable[KeyedJaggedTensor]]``.
        ctx: the module context; ``ctx.sharding_contexts[i]`` (when the context has them, same order)
            receives what the output dist of sharding ``i`` needs.
    """

    def __init__(self, awaitables: List[Awaitable[Awaitable[KeyedJaggedTensor]]], ctx: C) -> None:
        super().__init__()
        self.awaitables = list(awaitables)
        self.ctx = ctx

    def _wait_impl(self) -> KJTListAwaitable:
        tensors_awaitables = [w.wait() for w in self.awaitables]
        _record_intra_a2a(tensors_awaitables, self.ctx)
        return KJTListAwaitable(tensors_awaitables, self.ctx)


class ListOfKJTListAwaitable(Awaitable[ListOfKJTList]):
    """``wait()`` -> ``ListOfKJTList`` of each awaitable's ``KJTList`` (one per rank, in order)."""

    def __init__(self, awaitables: List[Awaitable[KJTList]]) -> None:
        super().__init__()
        self.awaitables = list(awaitables)

    def _wait_impl(self) -> ListOfKJTList:
        return ListOfKJTList([w.wait() for w in self.awaitables])


class ListOfKJTListSplitsAwaitable(Awaitable[Awaitable[ListOfKJTList]]):
    """``wait()`` waits each awaitable's first phase -> ``ListOfKJTListAwaitable``."""

    def __init__(self, awaitables: List[Awaitable[Awaitable[KJTList]]]) -> None:
        super().__init__()
        self.awaitables = list(awaitables)

    def _wait_impl(self) -> ListOfKJTListAwaitable:
        return ListOfKJTListAwaitable([w.wait() for w in self.awaitables])


class EmbeddingAwaitable(LazyAwaitable[torch.Tensor]):
    """A ``LazyAwaitable`` of one output dist's tensor: used like the tensor, waited on first use."""

    def __init__(self, awaitable: Awaitable[torch.Tensor]) -> None:
        super().__init__()
        self._awaitable = awaitable

    def _wait_impl(self) -> torch.Tensor:
        return self._awaitable.wait()


def construct_output_kt(
    embeddings: List[torch.Tensor], embedding_names: List[str], embedding_dims: List[int]
) -> KeyedTensor:
    """One ``KeyedTensor`` of pooled embeddings: ``embeddings`` (each ``[B, sum of its dims]``) side by
    side, keys ``embedding_names`` of widths ``embedding_dims``; ``ValueError`` when the widths do not
    add up to the columns."""
    values = embeddings[0] if len(embeddings) == 1 else torch.cat(embeddings, dim=1)
    if sum(embedding_dims) != values.size(1):
        raise ValueError(
            f"construct_output_kt: embedding_dims sum to {sum(embedding_dims)} but the embeddings have "
            f"{values.size(1)} columns"
        )
    return KeyedTensor(list(embedding_names), list(embedding_dims), values)


class EmbeddingBagCollectionAwaitable(LazyAwaitable[KeyedTensor]):
    """The pooled output of a sharded module: waits each sharding's output dist (``[B, dims]`` each, in
    sharding order) and returns their ``construct_output_kt``.

    Args:
        awaitables: each sharding's ``Awaitable[Tensor]``.
        embedding_dims / embedding_names: the widths and names of all output columns, in order.
    """

    def __init__(
        self, awaitables: List[Awaitable[torch.Tensor]], embedding_dims: List[int], embedding_names: List[str]
    ) -> None:
        super().__init__()
        self._awaitables = list(awaitables)
        self._embedding_dims = list(embedding_dims)
        self._embedding_names = list(embedding_names)

    def _wait_impl(self) -> KeyedTensor:
        return construct_output_kt(
            [w.wait() for w in self._awaitables], self._embedding_names, self._embedding_dims
        )


class EmbeddingCollectionAwaitable(LazyAwaitable[Dict[str, JaggedTensor]]):
    """The sequence output of a sharded module: one ``JaggedTensor`` per embedding name.

    Args:
        awaitables_per_sharding: each sharding's output dist, ``Awaitable[Tensor]`` of ``[ids, dim]``
            rows (its input features' ids in order, features of one width).
        features_per_sharding: each sharding's input KJT (this rank's batch): its lengths cut the rows.
        embedding_names_per_sharding: the output name of each key of that KJT.
        ctx: the module context; with ``ctx.reverse_indices`` (index deduplication), sharding ``i``'s
            rows are expanded by ``reverse_indices[i]`` and cut by ``ctx.input_features[i]``.
        need_indices: also put each id into its JaggedTensor's ``weights`` (torchrec's spelling).
    """

    def __init__(
        self,
        awaitables_per_sharding: List[Awaitable[torch.Tensor]],
        features_per_sharding: List[KeyedJaggedTensor],
        embedding_names_per_sharding: List[List[str]],
        ctx: Optional[EmbeddingCollectionContext] = None,
        need_indices: bool = False,
    ) -> None:
        super().__init__()
        if (
            not len(awaitables_per_sharding)
            == len(features_per_sharding)
            == len(embedding_names_per_sharding)
        ):
            raise ValueError(
                "EmbeddingCollectionAwaitable: one awaitable, one KJT and one name list per sharding, got "
                f"{len(awaitables_per_sharding)}, {len(features_per_sharding)}, "
                f"{len(embedding_names_per_sharding)}"
            )
        self._awaitables = list(awaitables_per_sharding)
        self._features = list(features_per_sharding)
        self._names = [list(n) for n in embedding_names_per_sharding]
        self._ctx = ctx
        self._need_indices = need_indices

    def _wait_impl(self) -> Dict[str, JaggedTensor]:
        reverse = list(self._ctx.reverse_indices) if self._ctx is not None else []
        out: Dict[str, JaggedTensor] = {}
        for i, (awaitable, features, names) in enumerate(zip(self._awaitables, self._features, self._names)):
            rows = awaitable.wait()
            if reverse:
                rows = rows.index_select(0, reverse[i])
                features = self._ctx.input_features[i]
            if len(names) != len(features.keys()):
                raise ValueError(
                    f"EmbeddingCollectionAwaitable: sharding {i} has {len(names)} embedding names for "
                    f"{len(features.keys())} keys {features.keys()}"
                )
            counts = features.length_per_key()
            if sum(counts) != rows.size(0):
                raise ValueError(
                    f"EmbeddingCollectionAwaitable: sharding {i} returned {rows.size(0)} rows for "
                    f"{sum(counts)} ids"
                )
            lengths = (
                features.lengths().split(features.stride_per_key())
                if features.variable_stride_per_key()
                else (features.lengths().view(len(names), -1) if names else [])
            )
            ids = features.values().split(counts)
            for name, part, key_lengths, key_ids in zip(names, rows.split(counts), lengths, ids):
                out[name] = JaggedTensor(
                    part, weights=key_ids if self._need_indices else None, lengths=key_lengths, validate=False
                )
        return out


__all__ = [
    "EmbeddingAwaitable",
    "EmbeddingBagCollectionAwaitable",
    "EmbeddingCollectionAwaitable",
    "KJTListAwaitable",
    "KJTListSplitsAwaitable",
    "ListOfKJTListAwaitable",
    "ListOfKJTListSplitsAwaitable",
    "construct_output_kt",
]
