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
    """World size of ``group`` (the default group when None); 1 when torch.distributed is not initialized
    and no group is given."""
    if isinstance(group, ProcessGroup):
        # what torch's get_world_size answers for a group object, without its ~10 Python calls of
        # lookups (the comm ops ask several times per step)
        return group.size()
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    """This process's rank within ``group``; 0 when torch.distributed is not initialized and no group
    is given."""
    if isinstance(group, ProcessGroup):
        return group.rank()  # the rank within the group, as torch's get_rank(group)
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


# dtypes get a small code in the shape exchange so that ranks can compare them cheaply
_DTYPE_CODES = {
    dtype: code
    for code, dtype in enumerate(
        (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
    )
}
# public name for other layers that put a dtype into an exchanged descriptor
DTYPE_CODES = _DTYPE_CODES
_MAX_DIMS = 16
_HEADER = 3  # ndim, dtype code, dim

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (same arguments) and warns on the
# old names; older releases have only the old ones
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_shapes(
    tensor: torch.Tensor, group: Optional[ProcessGroup] = None, dim: Optional[int] = None
) -> list[tuple[int, ...]]:
    """All-gather the shape of ``tensor`` from every rank of ``group`` (ranks may differ in ``ndim``).

    Also compares the dtype and, when given, the (normalized) ``dim`` a collective works along:
    a mismatch of either, or a tensor of more than 16 dimensions on any rank, raises the same
    ``ValueError`` on every rank. One all-gather of a small fixed-size int64 tensor (so it cannot
    itself mismatch), which costs one host sync.
    """
    if group_size(group) == 1:
        return [tuple(tensor.shape)]
    width = _HEADER + _MAX_DIMS
    meta = torch.full((width,), -1, dtype=torch.int64)
    meta[0] = tensor.dim()
    meta[1] = _DTYPE_CODES.get(tensor.dtype, -1)
    meta[2] = -1 if dim is None else dim
    if tensor.dim() <= _MAX_DIMS:
        meta[_HEADER : _HEADER + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    meta = meta.to(tensor.device)
    # a flat [world * width] buffer: gloo rejects a [world, width] output here
    out = torch.empty(group_size(group) * width, dtype=torch.int64, device=tensor.device)
    all_gather_flat(out, meta, group=group)
    rows = out.view(-1, width).tolist()
    too_many = [(rank, row[0]) for rank, row in enumerate(rows) if row[0] > _MAX_DIMS]
    if too_many:
        raise ValueError(
            f"tensors of more than {_MAX_DIMS} dimensions are not supported: (rank, ndim) {too_many}"
        )
    if any(row[1] != rows[0][1] for row in rows):
        codes = {code: dtype for dtype, code in _DTYPE_CODES.items()}
        dtypes = [codes.get(row[1], "another dtype") for row in rows]
        raise ValueError(f"ranks passed tensors of different dtypes: {format_per_rank(dtypes)}")
    if any(row[2] != rows[0][2] for row in rows):
        raise ValueError(f"ranks passed different dims: {format_per_rank([row[2] for row in rows])}")
    return [tuple(row[_HEADER : _HEADER + row[0]]) for row in rows]


def format_per_rank(values: Sequence[Any]) -> str:
    """``"rank 0: a, rank 1: b"`` for error messages."""
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
