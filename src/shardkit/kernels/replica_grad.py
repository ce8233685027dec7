"""This rank's row gradient of a FUSED data-parallel table, summed without sorting the ids.

The data-parallel replicas' backward (``shardkit.sharding.replicated_fused_lookup``) sums this rank's
gradient of every touched row into a kept buffer, exchanges the buffers and steps the rows. The
fused backward (:func:`shardkit.kernels.embedding_fused_backward`) would sort the ids by row first;
these two ops scatter in id order instead, giving the same sums (each row's terms added in id order,
from 0), with a native C++ backend (CPU, ``csrc/replica_grad.cpp``) and a pure-torch twin:

- :func:`touched_rows`: the distinct sorted rows the ids touch and each one's position among them;
- :func:`grad_scatter`: each touched target's summed gradient (a target: a buffer row, or its
  position among the touched rows), its flag set, every other target zeroed.

Arguments as in :mod:`shardkit.kernels.embedding` (``ids`` int32/int64 ``[N]``, ``offsets`` int64
``[B + 1]``, ``bag_shift`` int64 ``[B]`` or None, ``per_sample_weights`` fp32 ``[N]`` or None,
``bag_scale`` fp32 ``[B]`` or None, ``grad`` ``[B, D]`` or sample-major ``[S, B / S * D]`` when
``batch_major`` is S; ``[N, D]`` when not ``pooled``: one row per id, weights and scale unused).
"""

from __future__ import annotations

from typing import Optional

import torch

from shardkit.kernels import embedding_torch
from shardkit.kernels.embedding import native_for, rows_of_unit_stride
from shardkit.kernels.row_optimizer import RowOptimizerArgs


def _native(device: torch.device, ids: torch.Tensor):
    ops = native_for(device)
    if ops is None or ids.dtype not in (torch.int32, torch.int64) or not hasattr(ops, "replica_grad_scatter"):
        return None
    return ops


def _buffer_rows(ids, offsets, bag_shift, num_rows: int) -> torch.Tensor:
    """int64 ``[N]`` buffer row of each id; IndexError (as the native ops') for one outside the buffer."""
    rows = embedding_torch.buffer_rows(ids, offsets, bag_shift)
    bad = ((rows < 0) | (rows >= num_rows)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise IndexError(f"id at position {i} maps to buffer row {int(rows[i])}, outside [0, {num_rows})")
    return rows


def touched_rows(
    marks: torch.Tensor,
    position: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_shift: Optional[torch.Tensor],
) -> torch.Tensor:
    """The distinct buffer rows the ids touch (int64 ``[U]``, ascending), and ``position[row]`` set to
    each one's index among them (the other entries of ``position`` are left as they were).

    ``marks``: bool or uint8 ``[R]`` (R: the buffer's rows), all False on entry and on return (kept
    scratch: no sort, no memset of it). ``position``: int64 ``[R]``. A row outside ``[0, R)`` raises
    IndexError before anything is written."""
    ops = _native(marks.device, ids)
    if ops is not None:
        ids, offsets = ids.contiguous(), offsets.to(torch.int64).contiguous()
        shift = None if bag_shift is None else bag_shift.to(torch.int64).contiguous()
        return ops.replica_touched_rows(marks.view(torch.uint8), position, ids, offsets, shift)
    id_rows = _buffer_rows(ids, offsets, bag_shift, marks.numel())
    flags = marks.view(torch.bool)
    flags.index_fill_(0, id_rows, True)
    rows = flags.nonzero().squeeze(1)
    flags.index_fill_(0, rows, False)
    position.index_copy_(0, rows, torch.arange(rows.numel(), device=rows.device))
    return rows


def grad_scatter(
    out: torch.Tensor,
    seen: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_shift: Optional[torch.Tensor],
    per_sample_weights: Optional[torch.Tensor],
    bag_scale: Optional[torch.Tensor],
    grad: torch.Tensor,
    pooled: bool,
    batch_major: int,
    factor: float,
    position: Optional[torch.Tensor] = None,
    num_rows: Optional[int] = None,
) -> int:
    """Sum each touched target's gradient into ``out``; returns how many targets were touched.

    ``out``: fp32 ``[T, D]``, contents ignored (nothing is memset first). ``seen``: fp32 ``[T]``, all
    zero on entry. The target of id ``i`` is its buffer row (``position`` None: ``T`` = ``num_rows``,
    the buffer's rows) or ``position[row]`` (int64 ``[num_rows]``, from :func:`touched_rows`). On
    return, each touched target ``t`` has ``seen[t] = 1`` and ``out[t]`` = the sum over its ids, in id
    order from 0, of ``factor * w_i * scale_b * grad[b]`` (the fused backward's sum times ``factor``:
    bitwise the same for a power of two outside the subnormal range); every other target's row is 0."""
    num_rows = out.size(0) if num_rows is None else num_rows
    ops = _native(out.device, ids)
    if ops is not None:
        shift = None if bag_shift is None else bag_shift.to(torch.int64).contiguous()
        psw = None if per_sample_weights is None else per_sample_weights.to(torch.float32).contiguous()
        scale = None if bag_scale is None else bag_scale.to(torch.float32).contiguous()
        return ops.replica_grad_scatter(
            out,
            seen,
            ids.contiguous(),
            offsets.to(torch.int64).contiguous(),
            shift,
            psw,
            scale,
            rows_of_unit_stride(grad.to(torch.float32)),
            pooled,
            batch_major,
            factor,
            position,
            num_rows,
        )
    if not pooled:  # one row per id: nothing to weight or scale
        per_sample_weights = bag_scale = None
    targets = _buffer_rows(ids, offsets, bag_shift, num_rows)
    if position is not None:
        targets = position.index_select(0, targets)
    out.zero_()
    # the fused backward's SGD step of lr = -factor into zeros: factor times its sum, in id order
    sgd = RowOptimizerArgs("SGD", lr=-factor)
    embedding_torch.embedding_fused_backward(
        out, targets, offsets, None, per_sample_weights, bag_scale, grad, pooled, sgd, False, batch_major
    )
    seen.index_fill_(0, targets, 1.0)
    return int(seen.count_nonzero())


__all__ = ["grad_scatter", "touched_rows"]
