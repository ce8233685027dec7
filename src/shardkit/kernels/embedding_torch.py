"""Pure-torch backend of the embedding kernels: the reference every other backend is tested against.

Shapes and arguments are those of :mod:`shardkit.kernels.embedding` (the dispatching interface).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from shardkit.kernels.row_optimizer import RowOptimizerArgs, apply_rows_


def bag_of_each_id(offsets: torch.Tensor, num_ids: int) -> torch.Tensor:
    """int64 ``[num_ids]``: the bag index of each id, from ``offsets`` ``[bags + 1]`` (no host sync)."""
    bags = offsets.numel() - 1
    return torch.repeat_interleave(
        torch.arange(bags, device=offsets.device), offsets.diff(), output_size=num_ids
    )


def buffer_rows(ids: torch.Tensor, offsets: torch.Tensor, bag_shift: Optional[torch.Tensor]) -> torch.Tensor:
    """int64 ``[N]``: ``ids[i] + bag_shift[bag of i]``."""
    rows = ids.to(torch.int64)
    if bag_shift is None:
        return rows
    return rows + torch.repeat_interleave(bag_shift, offsets.diff(), output_size=rows.numel())


def to_batch_major(out: torch.Tensor, batch: int) -> torch.Tensor:
    """``[F * S, D]`` feature-major bags -> ``[S, F * D]`` (batch 0: unchanged)."""
    if batch == 0:
        return out
    return out.view(-1, batch, out.size(1)).transpose(0, 1).reshape(batch, -1)


def from_batch_major(grad: torch.Tensor, batch: int, dim: int) -> torch.Tensor:
    """``[S, F * dim]`` -> ``[F * S, dim]`` feature-major rows (batch 0: unchanged)."""
    if batch == 0:
        return grad
    return grad.reshape(batch, -1, dim).transpose(0, 1).reshape(-1, dim)


def pool(
    weight: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    weights: Optional[torch.Tensor],
    pooled: bool,
) -> torch.Tensor:
    """Differentiable lookup of buffer rows: ``[bags, D]`` weighted sums or ``[N, D]`` rows."""
    if not pooled:
        return F.embedding(rows, weight)
    return F.embedding_bag(
        rows, weight, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True
    )


def embedding_forward(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_shift: Optional[torch.Tensor],
    per_sample_weights: Optional[torch.Tensor],
    bag_scale: Optional[torch.Tensor],
    pooled: bool,
    batch_major: int = 0,
) -> torch.Tensor:
    rows = buffer_rows(ids, offsets, bag_shift)
    weights = None if per_sample_weights is None else per_sample_weights.to(weight.dtype)
    out = pool(weight, rows, offsets, weights, pooled)
    if pooled and bag_scale is not None:
        out = out * bag_scale.to(out.dtype).unsqueeze(1)
    return to_batch_major(out, batch_major)


def row_gradients(
    rows: torch.Tensor, sources: torch.Tensor, weights: Optional[torch.Tensor], grad: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradient of each distinct row, without a ``[N, D]`` per-id intermediate.

    rows: int64 ``[N]``; sources: int64 ``[N]``, the row of ``grad`` each id reads; weights: fp32
    ``[N]`` or None. Returns (touched rows int64 ``[U]`` ascending, fp32 ``[U, D]`` sums over the ids
    of each row of ``weights_i * grad[source_i]``, in id order). It is itself a pooled lookup:
    sorting the ids by row makes each row a bag whose members are the grad rows that read it.
    """
    sorted_rows, order = torch.sort(rows, stable=True)
    touched, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    row_offsets = torch.zeros(touched.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(counts, dim=0, out=row_offsets[1:])
    per_id = None if weights is None else weights.index_select(0, order)
    grad_rows = F.embedding_bag(
        sources.index_select(0, order),
        grad,
        row_offsets,
        mode="sum",
        per_sample_weights=per_id,
        include_last_offset=True,
    )
    return touched, grad_rows


@torch.no_grad()
def embedding_fused_backward(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_shift: Optional[torch.Tensor],
    per_sample_weights: Optional[torch.Tensor],
    bag_scale: Optional[torch.Tensor],
    grad: torch.Tensor,
    pooled: bool,
    optimizer: RowOptimizerArgs,
    want_psw_grad: bool,
    batch_major: int = 0,
) -> Optional[torch.Tensor]:
    rows = buffer_rows(ids, offsets, bag_shift)
    grad = from_batch_major(grad.to(torch.float32), batch_major, weight.size(1))
    if pooled and bag_scale is not None:
        grad = grad * bag_scale.to(torch.float32).unsqueeze(1)
    sources = (
        bag_of_each_id(offsets, rows.numel()) if pooled else torch.arange(rows.numel(), device=rows.device)
    )
    psw = None if per_sample_weights is None else per_sample_weights.to(torch.float32)
    psw_grad = None
    if want_psw_grad:
        # d out[bag] / d w_i = row i, read before the update below changes the rows
        looked_up = weight.index_select(0, rows).to(torch.float32)
        psw_grad = (grad.index_select(0, sources) * looked_up).sum(dim=1)
    touched, grad_rows = row_gradients(rows, sources, psw, grad)
    apply_rows_(weight, touched, grad_rows, optimizer)
    return psw_grad
