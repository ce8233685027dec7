"""Output dists of pooled embeddings: all-to-all (table/column-wise), reduce-scatter (row-wise), all-gather.

Each module wraps one differentiable, asynchronous comm op of ``shardkit.distributed.comm_ops`` and
returns a ``PooledEmbeddingsAwaitable``; its backward is the dual collective (gradients divided by
the world size while ``get_gradient_division()``). Argument checks, including the cross-rank ones,
are the comm op's: bad sizes or a disagreement between ranks raise ``ValueError`` on every rank
before any data moves (with validation on, ``shardkit.distributed.validation``).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.agreement import group_size
from shardkit.distributed.awaitable import Awaitable
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.comm_ops import (
    all_gather_base_pooled,
    alltoall_pooled,
    reduce_scatter_base_pooled,
    reduce_scatter_v_pooled,
)
from shardkit.distributed.comm_ops.placement import ColumnPlacement
from shardkit.distributed.comm_ops.pooled_alltoall import PlanCache, alltoall_pooled_placed


class PooledEmbeddingsAwaitable(Awaitable[torch.Tensor]):
    """The pooled embeddings after a collective: ``wait()`` waits for ``tensor_awaitable``, then applies
    ``callbacks`` in order (e.g. a ``PermutePooledEmbeddings``)."""

    def __init__(self, tensor_awaitable: Awaitable[torch.Tensor]) -> None:
        super().__init__()
        self._tensor_awaitable = tensor_awaitable

    def _wait_impl(self) -> torch.Tensor:
        return self._tensor_awaitable.wait()


class PooledEmbeddingsAllToAll(nn.Module):
    """Pooled embeddings computed for the whole batch on their owner -> every rank's own samples, all columns.

    Args:
        pg: the process group (None: the default group).
        dim_sum_per_rank: ``W`` ints, columns (sum of embedding dims) each rank computes.
        device: unused (buffers are allocated where the input lives); kept for the specification.
        callbacks: functions ``[B, D] -> [B, D']`` applied to every result, in order.
        codecs: wire precision of the forward data and of the gradients.
        placement: (shardkit) a ``ColumnPlacement``: the output's columns in its order instead of rank
            order (``dim_sum_per_rank`` must agree with it); one copy fewer than permuting after.

    ``forward(local_embs [sum(batch_size_per_rank), dim_sum_per_rank[me]], batch_size_per_rank=None)``
    -> awaitable of ``[batch_size_per_rank[me], sum(dim_sum_per_rank)]``, columns in rank order. Without
    ``batch_size_per_rank`` every rank has ``local_embs.size(0) / W`` samples.
    """

    def __init__(
        self,
        pg: Optional[dist.ProcessGroup],
        dim_sum_per_rank: List[int],
        device: Optional[torch.device] = None,
        callbacks: Optional[List[Callable[[torch.Tensor], torch.Tensor]]] = None,
        codecs: Optional[QuantizedCommCodecs] = None,
        *,
        placement: Optional[ColumnPlacement] = None,
    ) -> None:
        super().__init__()
        del device
        self._pg = pg
        self._dim_sum_per_rank = list(dim_sum_per_rank)
        self._callbacks = list(callbacks or [])
        self._codecs = codecs
        self._placement = placement
        # the comm op's plans, reused while validation is off (the same sizes every step)
        self._plans: PlanCache = {}
        per_rank = None if placement is None else [placement.columns(r) for r in range(len(placement.dest))]
        if per_rank is not None and per_rank != self._dim_sum_per_rank:
            raise ValueError(
                f"the placement's columns per rank {per_rank} differ from dim_sum_per_rank "
                f"{self._dim_sum_per_rank}"
            )

    @property
    def callbacks(self) -> List[Callable[[torch.Tensor], torch.Tensor]]:
        """Applied to every result in order; append to add one."""
        return self._callbacks

    def forward(
        self, local_embs: torch.Tensor, batch_size_per_rank: Optional[List[int]] = None
    ) -> PooledEmbeddingsAwaitable:
        if batch_size_per_rank is None:
            # an indivisible size gives sizes that do not fit the input, which the comm op
            # reports on every rank
            world = group_size(self._pg)
            batch_size_per_rank = [local_embs.size(0) // world] * world
        if self._placement is not None:
            request = alltoall_pooled_placed(
                local_embs,
                batch_size_per_rank,
                self._placement,
                group=self._pg,
                codecs=self._codecs,
                plans=self._plans,
            )
        else:
            request = alltoall_pooled(
                local_embs,
                batch_size_per_rank,
                self._dim_sum_per_rank,
                group=self._pg,
                codecs=self._codecs,
            )
        awaitable = PooledEmbeddingsAwaitable(request)
        awaitable.callbacks.extend(self._callbacks)
        return awaitable


class PooledEmbeddingsReduceScatter(nn.Module):
    """Partial pooled sums of every rank's samples -> this rank's samples, summed over ranks (row-wise).

    ``forward(local_embs [sum(input_splits), D], input_splits=None)`` -> awaitable of
    ``[input_splits[me], D]``: the sum over ranks of each rank's block ``me``. Without ``input_splits``
    (or with equal ones) the blocks are ``local_embs.size(0) / W`` rows each.
    """

    def __init__(self, pg: Optional[dist.ProcessGroup], codecs: Optional[QuantizedCommCodecs] = None) -> None:
        super().__init__()
        self._pg = pg
        self._codecs = codecs

    def forward(
        self, local_embs: torch.Tensor, input_splits: Optional[List[int]] = None
    ) -> PooledEmbeddingsAwaitable:
        if input_splits is not None and len(set(input_splits)) > 1:
            request = reduce_scatter_v_pooled(
                local_embs, list(input_splits), group=self._pg, codecs=self._codecs
            )
        else:
            request = reduce_scatter_base_pooled(local_embs, group=self._pg, codecs=self._codecs)
        return PooledEmbeddingsAwaitable(request)


class PooledEmbeddingsAllGather(nn.Module):
    """Every rank's ``[B, D]`` -> ``[W * B, D]`` on every rank (blocks in rank order).

    Backward sums each block's gradient over ranks and returns it to its owner.
    """

    def __init__(self, pg: Optional[dist.ProcessGroup], codecs: Optional[QuantizedCommCodecs] = None) -> None:
        super().__init__()
        self._pg = pg
        self._codecs = codecs

    def forward(self, local_emb: torch.Tensor) -> PooledEmbeddingsAwaitable:
        return PooledEmbeddingsAwaitable(
            all_gather_base_pooled(local_emb, group=self._pg, codecs=self._codecs)
        )


__all__ = [
    "PooledEmbeddingsAllGather",
    "PooledEmbeddingsAllToAll",
    "PooledEmbeddingsAwaitable",
    "PooledEmbeddingsReduceScatter",
]
