"""Several lookup groups' fused lookups as one autograd node, their outputs side by side.

Tables of k widths are k lookup groups (one buffer each), and a sharded lookup runs all of its rank's
groups every step. Each group through its own module call, :class:`~shardkit.modules.lookup_kernels.
FusedLookup` node and a cat of the outputs cost ~0.1 ms of Python and autograd work beyond its kernels
(one process, 8 groups of 64 bags, forward + fused SGD backward: 1.14 ms a step against 0.28 ms with
the kernels called from one node). :class:`FusedGroupsLookup` makes the same kernel calls, with the
same arguments and in the same order, from one node: the results are the same bit for bit.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from shardkit.kernels import embedding_fused_backward
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup, KernelInputs

__all__ = ["FusedGroupsLookup", "fuses_groups", "lookup_groups"]


class FusedGroupsLookup(torch.autograd.Function):
    """forward(lookups, inputs, *buffers) -> ``[S, sum of features x width]``: each group's sample-major
    pooled lookup (``inputs[g]``, from ``lookups[g].kernel_inputs(..., sample_major=True)``) in
    ``lookups``' order along the columns, in the buffers' dtype. ``buffers``: the groups' ``weight``s
    (so the output is part of the graph); they get no gradient: the backward applies each group's fused
    optimizer to the rows it read, as :class:`~shardkit.modules.lookup_kernels.FusedLookup` does."""

    @staticmethod
    def forward(ctx, lookups, inputs, *buffers):
        outputs = [lookup.run_kernel(group_inputs) for lookup, group_inputs in zip(lookups, inputs)]
        ctx.lookups = lookups
        ctx.inputs = inputs
        ctx.widths = [output.size(1) for output in outputs]
        return torch.cat(outputs, dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        for lookup, x, grad in zip(ctx.lookups, ctx.inputs, grad_out.split(ctx.widths, dim=1)):
            embedding_fused_backward(
                lookup.weight,
                x.ids,
                x.offsets,
                x.bag_shift,
                x.weights,
                x.bag_scale,
                grad,
                True,
                lookup.optimizer.step_args(),
                False,
                x.batch_major,
            )
        return (None, None, *([None] * len(ctx.lookups)))


def fuses_groups(
    lookups: Sequence[torch.nn.Module], dtype: torch.dtype, weights: Optional[torch.Tensor]
) -> bool:
    """Whether :func:`lookup_groups` gives what calling each of ``lookups`` (pooled, sample-major) and
    concatenating their outputs in ``dtype`` gives: a training forward (grad on, not traced) of plain
    :class:`GroupedEmbeddingLookup` groups (not a quantized, offloaded or replicated one, no module
    hooks), each pooled with a fused optimizer on a trained buffer of ``dtype``, and per-id ``weights``
    (if any) that need no gradient."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if weights is not None and weights.requires_grad:
        return False
    return all(
        type(lookup) is GroupedEmbeddingLookup
        and lookup.pooled
        and lookup.optimizer is not None
        and lookup.weight.requires_grad
        and lookup.weight.dtype == dtype
        and not (lookup._forward_hooks or lookup._forward_pre_hooks)
        for lookup in lookups
    )


def lookup_groups(lookups: List[GroupedEmbeddingLookup], inputs: List[KernelInputs]) -> torch.Tensor:
    """:class:`FusedGroupsLookup` over ``lookups`` (where :func:`fuses_groups` holds)."""
    return FusedGroupsLookup.apply(lookups, inputs, *[lookup.weight for lookup in lookups])
