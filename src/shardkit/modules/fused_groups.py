"""Several lookup groups' fused lookups as one autograd node, their outputs side by side.

Tables of k widths are k lookup groups (one buffer each), and a sharded lookup (or an unsharded
``EmbeddingBagCollection``) runs all of its rank's groups every step. Each group through its own module
call, :class:`~shardkit.modules.lookup_kernels.FusedLookup` node and a cat of the outputs cost ~0.1 ms
of Python and autograd work beyond its kernels (one process, 8 groups of 64 bags, forward + fused SGD
backward: 1.14 ms a step against 0.28 ms with the kernels called from one node).
:class:`FusedGroupsLookup` makes the same kernel calls, with the same arguments and in the same order,
from one node: the results are the same bit for bit. Each group's kernel writes its columns of the one
output, and its backward reads its columns of the output's gradient where they are (the native kernels
take rows a stride apart): no concatenation forward and no contiguous copy of each group's gradient
backward (row-wise 2-rank steps of 3-16 widths 4-9 % faster, docs/performance.md). The data-parallel replicas
subclass it to make their groups' exchanges one collective (``shardkit.sharding.replicated_fused_lookup``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from shardkit.distributed.comm_ops import scratch
from shardkit.kernels import embedding_fused_backward
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup
from shardkit.sparse import KeyedJaggedTensor

__all__ = ["FusedGroupsLookup", "fuses_groups", "lookup_pooled_groups"]


class FusedGroupsLookup(torch.autograd.Function):
    """forward(lookups, inputs, *buffers) -> ``[S, sum of features x width]``: each group's sample-major
    pooled lookup (``inputs[g]``, from ``lookups[g].kernel_inputs(..., sample_major=True)``) in
    ``lookups``' order along the columns, in the buffers' dtype. ``buffers``: the groups' ``weight``s
    (so the output is part of the graph); they get no gradient: the backward applies each group's fused
    optimizer to the rows it read, as :class:`~shardkit.modules.lookup_kernels.FusedLookup` does."""

    @staticmethod
    def forward(ctx, lookups, inputs, *buffers):
        # each group's kernel writes its columns of one output (no concatenation), and its backward
        # reads its columns of the output's gradient in place (no copy)
        ctx.lookups = lookups
        ctx.inputs = inputs
        ctx.widths = [(len(x.bag_bounds) - 1) * lookup.embedding_dim for lookup, x in zip(lookups, inputs)]
        first = buffers[0]
        # a kept buffer where it is large on the CPU (lookup_kernels.lookup_output's reason)
        out = scratch.empty((inputs[0].batch_major, sum(ctx.widths)), first.dtype, first.device)
        for lookup, group_inputs, part in zip(lookups, inputs, out.split(ctx.widths, dim=1)):
            lookup.run_kernel(group_inputs, out=part)
        return out

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
    lookups: Sequence[torch.nn.Module], dtype: torch.dtype, group_class: type = GroupedEmbeddingLookup
) -> bool:
    """Whether :class:`FusedGroupsLookup` gives what calling each of ``lookups`` (pooled, sample-major)
    and concatenating their outputs in ``dtype`` gives: a training forward (grad on, not traced) of
    groups of exactly ``group_class`` (by default plain :class:`GroupedEmbeddingLookup`s, not a
    quantized, offloaded or replicated one), without module hooks, each pooled with a fused optimizer
    on a trained buffer of ``dtype``."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    return all(
        type(lookup) is group_class
        and lookup.pooled
        and lookup.optimizer is not None
        and lookup.weight.requires_grad
        and lookup.weight.dtype == dtype
        and not (lookup._forward_hooks or lookup._forward_pre_hooks)
        for lookup in lookups
    )


def lookup_pooled_groups(
    lookups: List[GroupedEmbeddingLookup],
    parts: Sequence[KeyedJaggedTensor],
    dtype: torch.dtype,
    weighted: bool,
    function: Any = FusedGroupsLookup,
    group_class: type = GroupedEmbeddingLookup,
) -> Optional[torch.Tensor]:
    """``[S, sum of features x width]``: each group's sample-major pooled lookup of its part of the batch
    (``parts[g]``, its features in the group's order; ``weighted``: with the parts' per-id weights) side
    by side, from one ``function`` node (an autograd Function called as :class:`FusedGroupsLookup`
    is; a replicated lookup passes its own with its ``group_class``). None where that does not give the
    same result (:func:`fuses_groups`, a variable batch size, zero samples, per-id weights that need a
    gradient): the caller then runs each group alone. Raises what each group's forward raises for its
    part."""
    if not fuses_groups(lookups, dtype, group_class):
        return None
    inputs = []
    for lookup, part in zip(lookups, parts):
        weights = part.weights_or_none() if weighted else None
        if part.variable_stride_per_key() or (weights is not None and weights.requires_grad):
            return None
        group_inputs = lookup.kernel_inputs(
            part.values(), part.offsets(), part.stride_per_key(), weights, sample_major=True
        )
        if group_inputs is None:  # zero samples: the group's own forward handles them
            return None
        inputs.append(group_inputs)
    return function.apply(lookups, inputs, *[lookup.weight for lookup in lookups])
