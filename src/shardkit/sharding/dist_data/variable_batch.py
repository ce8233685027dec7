"""Output dists of pooled embeddings with a variable batch size per feature (1-D layouts).

With a variable batch per feature, feature ``f`` of rank ``r`` has its own batch size, so the
embeddings no longer form a ``[B, D]`` matrix: they travel as a flat tensor of per-feature blocks
``[batch_size * embedding_dim]``. Both modules wrap a differentiable, asynchronous comm op whose
checks raise ``ValueError`` on every rank for bad or disagreeing sizes.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.comm_ops import reduce_scatter_v_per_feature_pooled, variable_batch_alltoall_pooled
from shardkit.sharding.dist_data.pooled import PooledEmbeddingsAwaitable


class VariableBatchPooledEmbeddingsAllToAll(nn.Module):
    """All-to-all of pooled embeddings whose features have per-rank batch sizes.

    Args:
        pg: the process group.
        emb_dim_per_rank_per_feature: ``[W][features of rank r]`` embedding dims.
        device: unused (kept for the specification).
        callbacks: applied to every (1-D) result in order.
        codecs: wire precision.

    ``forward(local_embs, batch_size_per_rank_per_feature, batch_size_per_feature_pre_a2a)``:
    ``local_embs`` (read flat) holds, for each destination rank ``r`` and each local feature ``f``,
    ``batch_size_per_rank_per_feature[r][f] * dim(f)`` values; the 1-D result holds, for each source
    rank ``s`` and each of its features (global feature ``g``, ordered by rank),
    ``batch_size_per_feature_pre_a2a[g] * dim`` values.
    """

    def __init__(
        self,
        pg: Optional[dist.ProcessGroup],
        emb_dim_per_rank_per_feature: List[List[int]],
        device: Optional[torch.device] = None,
        callbacks: Optional[List[Callable[[torch.Tensor], torch.Tensor]]] = None,
        codecs: Optional[QuantizedCommCodecs] = None,
    ) -> None:
        super().__init__()
        del device
        self._pg = pg
        self._emb_dims = [list(d) for d in emb_dim_per_rank_per_feature]
        self._callbacks = list(callbacks or [])
        self._codecs = codecs

    @property
    def callbacks(self) -> List[Callable[[torch.Tensor], torch.Tensor]]:
        return self._callbacks

    def forward(
        self,
        local_embs: torch.Tensor,
        batch_size_per_rank_per_feature: List[List[int]],
        batch_size_per_feature_pre_a2a: List[int],
    ) -> PooledEmbeddingsAwaitable:
        request = variable_batch_alltoall_pooled(
            local_embs,
            batch_size_per_rank_per_feature,
            batch_size_per_feature_pre_a2a,
            self._emb_dims,
            group=self._pg,
            codecs=self._codecs,
        )
        awaitable = PooledEmbeddingsAwaitable(request)
        awaitable.callbacks.extend(self._callbacks)
        return awaitable


class VariableBatchPooledEmbeddingsReduceScatter(nn.Module):
    """Reduce-scatter of flat per-feature blocks (row-wise sharding with a variable batch per feature).

    ``forward(local_embs [sum_r sum_f batch_size_per_rank_per_feature[r][f] * embedding_dims[f]],
    batch_size_per_rank_per_feature [W][F], embedding_dims [F])`` -> awaitable of this rank's block
    (1-D), summed over ranks.
    """

    def __init__(self, pg: Optional[dist.ProcessGroup], codecs: Optional[QuantizedCommCodecs] = None) -> None:
        super().__init__()
        self._pg = pg
        self._codecs = codecs

    def forward(
        self,
        local_embs: torch.Tensor,
        batch_size_per_rank_per_feature: List[List[int]],
        embedding_dims: List[int],
    ) -> PooledEmbeddingsAwaitable:
        request = reduce_scatter_v_per_feature_pooled(
            local_embs, batch_size_per_rank_per_feature, embedding_dims, group=self._pg, codecs=self._codecs
        )
        return PooledEmbeddingsAwaitable(request)


__all__ = ["VariableBatchPooledEmbeddingsAllToAll", "VariableBatchPooledEmbeddingsReduceScatter"]
