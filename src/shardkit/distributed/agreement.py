"""Cross-rank agreement checks: turn a disagreement between ranks into an error on every rank.

A collective called with mismatched arguments on different ranks can hang or corrupt memory. These
helpers exchange a small description of the call first, so that every rank sees every other rank's
view and raises the same ``ValueError`` instead of entering the collective.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def group_size(group: Optional[ProcessGroup]) -> int:
    """World size of ``group`` (the default group when None); 1 when torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    """This process's rank within ``group``; 0 when torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def gather_objects(obj: Any, group: Optional[ProcessGroup] = None) -> list:
    """All-gather a small picklable object; ``[obj]`` when there is no group to gather over."""
    if group_size(group) == 1:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def assert_same_on_all_ranks(obj: Any, what: str, group: Optional[ProcessGroup] = None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all ranks passed an equal ``obj``.

    ``what`` names the value in the message, e.g. ``"graph-parallel size"``.
    """
    values = gather_objects(obj, group)
    if any(v != values[0] for v in values[1:]):
        per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise ValueError(f"ranks disagree on the {what}: {per_rank}")


def gather_shapes(tensor: torch.Tensor, group: Optional[ProcessGroup] = None) -> list[tuple[int, ...]]:
    """All-gather the shape of ``tensor`` from every rank of ``group`` (ranks may differ in ``ndim``).

    One all-gather of a small int64 tensor of a fixed size (so it cannot itself mismatch), which
    costs one host sync.
    """
    if group_size(group) == 1:
        return [tuple(tensor.shape)]
    max_dims = 16
    if tensor.dim() > max_dims:
        raise ValueError(f"tensors of more than {max_dims} dimensions are not supported, got {tensor.dim()}")
    meta = torch.full((max_dims + 1,), -1, dtype=torch.int64, device=tensor.device)
    meta[0] = tensor.dim()
    meta[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    out = torch.empty(dist.get_world_size(group), max_dims + 1, dtype=torch.int64, device=tensor.device)
    dist.all_gather_into_tensor(out, meta, group=group)
    rows = out.tolist()
    return [tuple(row[1 : 1 + row[0]]) for row in rows]


def format_per_rank(values: Sequence[Any]) -> str:
    """``"rank 0: a, rank 1: b"`` for error messages."""
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
