"""The checks of the rows a :class:`~shardkit.kernels.offload.row_cache.RowCache` is asked for (L0)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch

from shardkit.kernels.embedding import RowOutOfRange


def checked_rows(rows: torch.Tensor, num_rows: int) -> Tuple[torch.Tensor, bool]:
    """``rows`` as int64 on the host, after the checks of ``RowCache.acquire`` (an integer tensor ``[U]`` of
    distinct rows in ``[0, num_rows)``), and whether they ascend.

    Rows from ``torch.unique`` (what the lookups pass) ascend strictly: checked in one pass, without
    the sort that finds a repeated row in any other order.
    """
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"RowCache.acquire: rows must be an integer tensor [U], got {type(rows).__name__}")
    if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
        raise TypeError(f"RowCache.acquire: rows must be an integer tensor, got dtype {rows.dtype}")
    if rows.dim() != 1:
        raise ValueError(f"RowCache.acquire: rows must be 1-D [U], got shape {tuple(rows.shape)}")
    rows = rows.to(device="cpu", dtype=torch.int64)
    if rows.numel() and bool((rows[1:] > rows[:-1]).all()):
        if int(rows[0]) >= 0 and int(rows[-1]) < num_rows:
            return rows, True
    if rows.numel():
        outside = (rows < 0) | (rows >= num_rows)
        if bool(outside.any()):
            position = int(outside.nonzero()[0, 0])
            raise RowOutOfRange(position, int(rows[position]), num_rows)
        ordered = rows.sort().values
        repeated = ordered[1:] == ordered[:-1]
        if bool(repeated.any()):
            row = int(ordered[1:][repeated][0])
            raise ValueError(f"RowCache.acquire: rows must be distinct; row {row} appears more than once")
    return rows, rows.numel() == 0


@dataclasses.dataclass
class IdCheck:
    """A caller's own check of the ids it passes to ``RowCache.acquire_ids``, folded into the acquire's
    host sync (the device bookkeeping brings its counts to the host once an acquire; a lookup's id check
    would cost a second sync).

    Attributes:
        bad: None, or a 0-d integer tensor on the ids' device: how many ids the caller rejects (computed
            by queued ops, no sync). None: the cache's own range check ``[0, R)`` is the caller's check.
        raise_error: called (before anything is pinned, evicted or loaded) when ``bad`` is nonzero or an
            id is outside ``[0, R)``; raises the caller's error (naming its feature, table, id, range).
            Should it return, the cache raises its own ``RowOutOfRange`` (or an IndexError saying that
            the caller rejected ids without naming one).
    """

    bad: Optional[torch.Tensor]
    raise_error: Callable[[], None]


__all__ = ["IdCheck", "checked_rows"]
