"""Compute kernels behind one interface per op (L0): pure torch always, native C++ on CPU, Triton on CUDA.

See :mod:`shardkit.kernels.embedding` for the embedding-lookup ops and docs/performance.md for how the
backends compare. ``SHARDKIT_NATIVE=0`` keeps the native C++ kernels off.
"""

from shardkit.kernels.bucketize import bucketize_blocks
from shardkit.kernels.embedding import (
    BACKENDS,
    RowOutOfRange,
    embedding_forward,
    embedding_fused_backward,
    kernel_backend,
    native_for,
    select_backend,
)
from shardkit.kernels.embedding_torch import bag_of_each_id
from shardkit.kernels.native_build import native_enabled_by_env, native_failure, native_ops
from shardkit.kernels.row_optimizer import OPTIMIZERS, RowOptimizerArgs

__all__ = [
    "BACKENDS",
    "OPTIMIZERS",
    "RowOutOfRange",
    "RowOptimizerArgs",
    "bag_of_each_id",
    "bucketize_blocks",
    "embedding_forward",
    "embedding_fused_backward",
    "kernel_backend",
    "native_enabled_by_env",
    "native_failure",
    "native_for",
    "native_ops",
    "select_backend",
]
