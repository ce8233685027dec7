"""Output dist of sequence embeddings: one embedding row per id, back to the rank that sent the id.

The answer to a ``KJTAllToAll``: rank ``me`` looked up one row per id it received, in the order of
the KJT all-to-all's output (feature-major: local feature ``i``, then each source rank's rows). The
rows are regrouped by source rank (the inverse of the KJT recat) and sent back, so each rank gets
its ids' rows in the order of its own input (features grouped by destination rank).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.agreement import group_rank, group_size
from shardkit.distributed.awaitable import Awaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.comm_ops import alltoall_sequence
from shardkit.sharding.dist_data.recat import expand_recat, get_recat


class SequenceEmbeddingsAwaitable(Awaitable[torch.Tensor]):
    """Sequence embeddings after the all-to-all: ``[N, D]``, then (row-wise sharding) rows reordered by
    ``unbucketize_permute_tensor`` (``result = rows[unbucketize_permute_tensor]``)."""

    def __init__(
        self,
        tensor_awaitable: Awaitable[torch.Tensor],
        unbucketize_permute_tensor: Optional[torch.Tensor],
        embedding_dim: int,
    ) -> None:
        super().__init__()
        self._tensor_awaitable = tensor_awaitable
        self._unbucketize_permute_tensor = unbucketize_permute_tensor
        self._embedding_dim = embedding_dim

    def _wait_impl(self) -> torch.Tensor:
        rows = self._tensor_awaitable.wait()
        if self._unbucketize_permute_tensor is not None:
            rows = rows.view(-1, self._embedding_dim).index_select(0, self._unbucketize_permute_tensor)
        return rows


class SequenceEmbeddingsAllToAll(nn.Module):
    """Sends looked-up sequence embeddings back to the ranks their ids came from.

    Args:
        pg: the process group.
        features_per_rank: ``W`` ints, the features each rank received (the ``splits`` of the
            ``KJTAllToAll`` this answers).
        device: unused (kept for the specification).
        codecs: wire precision.

    ``forward(local_embs, lengths, input_splits, output_splits, unbucketize_permute_tensor=None,
    batch_size_per_rank=None, sparse_features_recat=None)``:

    - ``local_embs`` ``[N, D]``: one row per id received, in the KJT all-to-all output's order;
    - ``lengths``: that output's lengths; ``input_splits`` / ``output_splits``: the ids this rank sent
      to / received from each rank (the KJT awaitable's ``input_splits["values"]`` /
      ``output_splits["values"]``);
    - ``batch_size_per_rank``: each rank's batch size (its ``stride_per_rank``); when they differ the
      rows are regrouped sample by sample;
    - ``sparse_features_recat``: the KJT awaitable's ``recat``; derived from ``features_per_rank`` and
      ``batch_size_per_rank`` when omitted (stagger 1).

    Returns an awaitable of ``[sum(input_splits), D]``, rows in the order of this rank's input ids.
    Backward: the gradient rows travel back the same way (divided by ``W`` with gradient division).
    """

    def __init__(
        self,
        pg: Optional[dist.ProcessGroup],
        features_per_rank: List[int],
        device: Optional[torch.device] = None,
        codecs: Optional[QuantizedCommCodecs] = None,
    ) -> None:
        super().__init__()
        del device
        self._pg = pg
        self._world = group_size(pg)
        self._features_per_rank = list(features_per_rank)
        if len(self._features_per_rank) != self._world:
            # the same on every rank (a group property and a constructor argument), so raising here is safe
            raise ValueError(
                f"SequenceEmbeddingsAllToAll: features_per_rank {self._features_per_rank} has "
                f"{len(self._features_per_rank)} entries for a group of {self._world} ranks"
            )
        self._local = self._features_per_rank[group_rank(pg)]
        self._codecs = codecs

    def forward(
        self,
        local_embs: torch.Tensor,
        lengths: torch.Tensor,
        input_splits: List[int],
        output_splits: List[int],
        unbucketize_permute_tensor: Optional[torch.Tensor] = None,
        batch_size_per_rank: Optional[List[int]] = None,
        sparse_features_recat: Optional[torch.Tensor] = None,
    ) -> SequenceEmbeddingsAwaitable:
        variable = batch_size_per_rank is not None and len(set(batch_size_per_rank)) > 1
        recat = sparse_features_recat
        if recat is None and self._local > 0 and self._world > 1:
            order = get_recat(self._local, self._world)
            if variable:
                rows = [b for b in batch_size_per_rank for _ in range(self._local)]
                recat = expand_recat(order, rows, lengths.device)
            elif self._local > 1:  # one feature per rank: the order is already source-major
                recat = torch.tensor(order, dtype=torch.int64, device=lengths.device)
        forward_recat = backward_recat = None
        if recat is not None and recat.numel() > 0:
            # the KJT recat maps received (source-major) segments to feature-major ones; sending back
            # needs the inverse
            backward_recat = recat.to(torch.int64)
            forward_recat = torch.argsort(backward_recat)
        request = alltoall_sequence(
            local_embs,
            forward_recat,
            backward_recat,
            lengths,
            input_splits,
            output_splits,
            variable_batch_size=variable,
            group=self._pg,
            codecs=self._codecs,
        )
        return SequenceEmbeddingsAwaitable(request, unbucketize_permute_tensor, local_embs.size(1))


__all__ = ["SequenceEmbeddingsAllToAll", "SequenceEmbeddingsAwaitable"]
