"""Copy column ranges between two row-major matrices: the pooled all-to-all's column placement.

``copy_column_ranges(dst, src, ranges)``: ``dst`` ``[R, Cd]`` and ``src`` ``[R, Cs]`` (contiguous CPU
tensors of one dtype), ``ranges`` int64 ``[K, 3]`` of ``(source column, destination column, columns)``:
row r's ``src[r, s : s + n]`` goes to ``dst[r, d : d + n]``. The native op (``csrc/columns.cpp``) makes
one memcpy per row and range. ``distributed.comm_ops.placement.ColumnPlacement`` takes it as its
``copier`` (the sharding layer hands it over: comm ops cannot import kernels); without one it moves the
columns by strided copies of whole runs or one ``index_copy_``, the pure-torch path.

Why: a rank holding tables of many different widths has one run of columns per table, and the
placement of ``index_copy_`` over 4-column blocks took 0.8 ms for a ``[256, 1088]`` piece where this
takes tens of microseconds (docs/performance.md, nineteenth session).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from shardkit.kernels.native_build import native_ops


def copy_column_ranges(dst: torch.Tensor, src: torch.Tensor, ranges: torch.Tensor) -> None:
    """The native op (module doc); ``RuntimeError`` naming the range outside either matrix."""
    native_ops().copy_column_ranges(dst, src, ranges)


def copy_column_ranges_torch(dst: torch.Tensor, src: torch.Tensor, ranges: torch.Tensor) -> None:
    """The pure-torch twin of :func:`copy_column_ranges`: one strided copy per range."""
    for s, d, n in ranges.tolist():
        if not (0 <= s and 0 <= d and 0 <= n and s + n <= src.size(1) and d + n <= dst.size(1)):
            raise RuntimeError(
                f"copy_column_ranges: range (source {s}, destination {d}, {n} columns) is outside src "
                f"{list(src.shape)} or dst {list(dst.shape)}"
            )
        dst[:, d : d + n].copy_(src[:, s : s + n])


def column_copier() -> Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]]:
    """:func:`copy_column_ranges` where the native kernels are loaded, else None (the placement's own
    pure-torch path)."""
    ops = native_ops()
    return copy_column_ranges if ops is not None and hasattr(ops, "copy_column_ranges") else None


__all__ = ["column_copier", "copy_column_ranges", "copy_column_ranges_torch"]
