"""The lookup of one embedding buffer as an autograd op, on the kernels of :mod:`shardkit.kernels`.

Two backward modes share the same forward:

- plain autograd (no optimizer): the buffer gets a dense gradient, like ``nn.EmbeddingBag``; this
  runs the differentiable pure-torch path;
- fused (``optimizer`` given): :class:`FusedLookup`'s backward hands the output gradient to the
  kernel backend (native C++ on CPU, Triton on CUDA, else pure torch), which sums the gradient of each
  touched row and applies the optimizer to it in place; the buffer gets *no* gradient.

Ids here are table ids; ``bag_shift`` turns them into buffer rows (see :mod:`shardkit.kernels.embedding`).
"""

from __future__ import annotations

from typing import Optional

import torch

from shardkit.distributed.comm_ops import scratch
from shardkit.kernels import embedding_forward, embedding_fused_backward, embedding_torch
from shardkit.kernels.embedding import select_backend
from shardkit.modules.fused_optimizers import SparseRowOptimizer

__all__ = ["FusedLookup", "lookup", "lookup_output"]


def lookup_output(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_shift: Optional[torch.Tensor],
    weights: Optional[torch.Tensor],
    bag_scale: Optional[torch.Tensor],
    pooled: bool,
    batch_major: int,
) -> torch.Tensor:
    """``kernels.embedding_forward``'s result (same arguments, same values). Where the native kernels run
    it, written into a buffer of ``distributed.comm_ops.scratch``: a large output (MiBs at large
    batches) is then a kept buffer, handed out again once nothing refers to it, not fresh pages that
    the kernel faults in and zeroes every step (sweep row 40's 32 MiB output: 11.7 ms a call with a
    fresh output, 7.8 ms into a kept one; docs/performance.md, twenty-third session)."""
    if select_backend(weight, ids) != "native":
        return embedding_forward(weight, ids, offsets, bag_shift, weights, bag_scale, pooled, batch_major)
    dim = weight.size(1)
    if not pooled:
        shape = (ids.numel(), dim)
    elif batch_major:
        shape = (batch_major, (offsets.numel() - 1) // batch_major * dim)
    else:
        shape = (offsets.numel() - 1, dim)
    out = scratch.empty(shape, weight.dtype, weight.device)
    return embedding_forward(
        weight, ids, offsets, bag_shift, weights, bag_scale, pooled, batch_major, out=out
    )


class FusedLookup(torch.autograd.Function):
    """Lookup whose backward applies ``optimizer`` to the touched rows of ``weight`` in place.

    forward(weight [R, D], ids int32/int64 [N], offsets int64 [B + 1], bag_shift int64 [B] or None,
    weights [N] or None, bag_scale fp32 [B] or None, pooled, batch_major, optimizer) -> [B, D],
    [S, B / S * D] (batch_major S) or [N, D].
    Saved for backward: ids, offsets, bag_shift, weights, bag_scale; ``weight`` is kept by reference
    and not versioned, because the backward itself modifies it (two forwards before one backward see
    the first update). Backward returns no gradient for ``weight``; the per-sample weights get theirs
    (``scale * <grad, row>``, computed from the rows before the update).
    """

    @staticmethod
    def forward(
        ctx,
        weight,
        ids,
        offsets,
        bag_shift,
        weights,
        bag_scale,
        pooled,
        batch_major,
        optimizer: SparseRowOptimizer,
    ):
        ctx.weight = weight
        ctx.optimizer = optimizer
        ctx.pooled = pooled
        ctx.batch_major = batch_major
        ctx.save_for_backward(ids, offsets, bag_shift, weights, bag_scale)
        return lookup_output(weight, ids, offsets, bag_shift, weights, bag_scale, pooled, batch_major)

    @staticmethod
    def backward(ctx, grad_out):
        ids, offsets, bag_shift, weights, bag_scale = ctx.saved_tensors
        want_psw_grad = weights is not None and ctx.needs_input_grad[4]
        psw_grad = embedding_fused_backward(
            ctx.weight,
            ids,
            offsets,
            bag_shift,
            weights,
            bag_scale,
            grad_out,
            ctx.pooled,
            ctx.optimizer.step_args(),
            want_psw_grad,
            ctx.batch_major,
        )
        psw_grad = None if psw_grad is None else psw_grad.to(weights.dtype)
        return None, None, None, None, psw_grad, None, None, None, None


def lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_shift: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    bag_scale: Optional[torch.Tensor] = None,
    pooled: bool = True,
    optimizer: Optional[SparseRowOptimizer] = None,
    batch_major: int = 0,
) -> torch.Tensor:
    """One kernel call over one buffer (arguments as in :mod:`shardkit.kernels.embedding`).

    Returns ``[B, D]`` (scaled, weighted) sums, ``[S, B / S * D]`` (batch_major S) or ``[N, D]`` rows, in
    weight's dtype.
    """
    grad_needed = torch.is_grad_enabled() and (
        weight.requires_grad or (weights is not None and weights.requires_grad)
    )
    if not grad_needed:
        return embedding_forward(weight, ids, offsets, bag_shift, weights, bag_scale, pooled, batch_major)
    if optimizer is not None and weight.requires_grad:
        return FusedLookup.apply(
            weight, ids, offsets, bag_shift, weights, bag_scale, pooled, batch_major, optimizer
        )
    return embedding_torch.embedding_forward(
        weight, ids, offsets, bag_shift, weights, bag_scale, pooled, batch_major
    )
