"""The lookup kernel of one embedding buffer: pooled (embedding_bag) or sequence (embedding) rows.

Two backward modes share the same forward:

- plain autograd (``optimizer=None``): the buffer gets a dense gradient, like ``nn.EmbeddingBag``;
- fused (``optimizer`` given): :class:`FusedLookup`'s backward sums the gradient of each touched row
  (:func:`row_gradients`) and hands those rows to the optimizer, which updates them in place; it
  returns *no* gradient for the buffer.

Ids here are rows of the buffer (already shifted from table ids by the grouped lookup).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from shardkit.modules.fused_optimizers import SparseRowOptimizer


def _pool(
    weight: torch.Tensor, rows: torch.Tensor, offsets: Optional[torch.Tensor], weights: Optional[torch.Tensor]
) -> torch.Tensor:
    if offsets is None:
        return F.embedding(rows, weight)
    return F.embedding_bag(
        rows, weight, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True
    )


def bag_of_each_id(offsets: torch.Tensor, num_ids: int) -> torch.Tensor:
    """int64 ``[num_ids]``: the bag index of each id, from ``offsets`` ``[bags + 1]`` (no host sync)."""
    bags = offsets.numel() - 1
    return torch.repeat_interleave(
        torch.arange(bags, device=offsets.device), offsets.diff(), output_size=num_ids
    )


class FusedLookup(torch.autograd.Function):
    """Lookup whose backward applies ``optimizer`` to the touched rows of ``weight`` in place.

    forward(weight [R, D], rows int64 [N], offsets int64 [bags + 1] or None, weights [N] or None,
    optimizer) -> [bags, D] (weighted sums) or [N, D] (offsets None).
    Saved for backward: rows, offsets, weights; ``weight`` is kept by reference and not versioned,
    because the backward itself modifies it (two forwards before one backward see the first update).
    Backward returns no gradient for ``weight``; the per-sample weights get theirs (``<grad, row>``,
    computed from the rows before the update).
    """

    @staticmethod
    def forward(ctx, weight, rows, offsets, weights, optimizer: SparseRowOptimizer):
        ctx.weight = weight
        ctx.optimizer = optimizer
        ctx.save_for_backward(rows, offsets, weights)
        return _pool(weight, rows, offsets, weights)

    @staticmethod
    def backward(ctx, grad_out):
        rows, offsets, weights = ctx.saved_tensors
        weight = ctx.weight
        # fp32 from here on: a half-precision table must not accumulate its gradients in half
        grad_out = grad_out.to(torch.float32)
        grad_weights = None
        if weights is not None and ctx.needs_input_grad[3]:
            # d out[bag] / d weights[i] = row i, so the weight's gradient is <grad_out[bag_i], row_i>,
            # read before the update below changes the rows
            grad_per_id = grad_out.index_select(0, bag_of_each_id(offsets, rows.numel()))
            looked_up = weight.index_select(0, rows).to(torch.float32)
            grad_weights = (grad_per_id * looked_up).sum(dim=1).to(weights.dtype)
        touched, grad_rows = row_gradients(rows, offsets, weights, grad_out)
        ctx.optimizer.step_rows_(weight, touched, grad_rows)
        return None, None, None, grad_weights, None


def row_gradients(
    rows: torch.Tensor,
    offsets: Optional[torch.Tensor],
    weights: Optional[torch.Tensor],
    grad_out: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradient of each distinct looked-up row, without a ``[N, D]`` per-id intermediate.

    Returns (touched rows int64 ``[U]`` ascending, fp32 ``[U, D]`` sums over the ids of each row of
    ``weight_i * grad_out[bag_i]``). It is itself a pooled lookup: sorting the ids by row makes each
    row a bag whose members are the bags (rows of grad_out) that read it.
    """
    sorted_rows, order = torch.sort(rows)
    touched, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    row_offsets = torch.zeros(touched.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(counts, dim=0, out=row_offsets[1:])
    sources = order if offsets is None else bag_of_each_id(offsets, rows.numel()).index_select(0, order)
    per_id = None if weights is None else weights.to(grad_out.dtype).index_select(0, order)
    grad_rows = F.embedding_bag(
        sources, grad_out, row_offsets, mode="sum", per_sample_weights=per_id, include_last_offset=True
    )
    return touched, grad_rows


def lookup(
    weight: torch.Tensor,
    rows: torch.Tensor,
    offsets: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    optimizer: Optional[SparseRowOptimizer] = None,
) -> torch.Tensor:
    """One kernel call over one buffer.

    weight: ``[R, D]``; rows: int64 ``[N]`` buffer rows; offsets: int64 ``[bags + 1]`` starting at 0 and
    ending at N (pooled) or None (one output row per id); weights: ``[N]`` of weight's dtype or None.
    Returns ``[bags, D]`` weighted sums or ``[N, D]`` rows, in weight's dtype.
    """
    if optimizer is not None and torch.is_grad_enabled() and weight.requires_grad:
        return FusedLookup.apply(weight, rows, offsets, weights, optimizer)
    return _pool(weight, rows, offsets, weights)
