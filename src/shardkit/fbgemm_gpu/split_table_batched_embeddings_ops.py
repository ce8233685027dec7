"""fbgemm's ``fbgemm_gpu.split_table_batched_embeddings_ops``: the same names as
``split_table_batched_embeddings_ops_common`` (fbgemm re-exports them there)."""

from __future__ import annotations

from shardkit.fbgemm_gpu import split_table_batched_embeddings_ops_common as _common
from shardkit.fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode

__all__ = ["BoundsCheckMode", "PoolingMode"]  # and CacheAlgorithm, on first use


def __getattr__(name: str):
    return _common.__getattr__(name)
