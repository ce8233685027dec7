"""The fused optimizer on data-parallel tables: every replica applies the same update in backward.

A data-parallel table is whole on every rank and each rank looks up its own samples. With the DENSE
kernel its gradient is averaged by the model's data-parallel wrapper and a dense optimizer steps it.
With the FUSED kernel (a collection that asks for a fused optimizer: its own, an in-backward one or
the sharder's ``fused_params``) this module's backward

1. computes this rank's gradient of the buffer ``[rows, dim]`` (fp32) and which rows its ids touched;
2. sums both over the ranks with one all-reduce (the gradient divided by the world size while
   ``get_gradient_division()``, as the other shardings' output dists divide theirs);
3. applies the fused optimizer's rule (``shardkit.kernels.row_optimizer.apply_rows_``) to the rows any
   rank touched, on every rank alike,

so the replicas stay equal and take the step the unsharded module takes on the global batch (lazy
rules such as ADAM move only touched rows, as there). The weight gets no ``.grad``: it stays out of
the data-parallel wrapper (``ShardedEmbeddingModule.sharded_parameter_names``).
Cost: one all-reduce of ``rows x dim + rows`` fp32 values per group of tables per backward (a dense
table's gradient all-reduce costs the same); every rank must run the backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.comm_ops import get_gradient_division
from shardkit.kernels import embedding_forward, embedding_torch
from shardkit.kernels.row_optimizer import apply_rows_
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup
from shardkit.sharding.embedding_lookup import ShardedGroupedLookup


class _ReplicatedFusedFn(torch.autograd.Function):
    """forward(weight [R, D], weights [N] or None, ids, offsets, bag_shift, bag_scale, pooled,
    batch_major, lookup) -> the lookup's output; backward: all-reduced rows update (module doc)."""

    @staticmethod
    def forward(ctx, weight, weights, ids, offsets, bag_shift, bag_scale, pooled, batch_major, lookup):
        ctx.weight = weight  # by reference: the backward updates it in place (as FusedLookup)
        ctx.lookup, ctx.pooled, ctx.batch_major = lookup, pooled, batch_major
        ctx.save_for_backward(ids, offsets, bag_shift, weights, bag_scale)
        return embedding_forward(weight, ids, offsets, bag_shift, weights, bag_scale, pooled, batch_major)

    @staticmethod
    def backward(ctx, grad_out):
        ids, offsets, bag_shift, weights, bag_scale = ctx.saved_tensors
        lookup: ReplicatedFusedLookup = ctx.lookup
        weight = ctx.weight
        want_psw = weights is not None and ctx.needs_input_grad[1]
        with torch.enable_grad():
            leaf = weight.detach().to(torch.float32).requires_grad_()
            psw = None if weights is None else weights.detach().requires_grad_(want_psw)
            out = embedding_torch.embedding_forward(
                leaf, ids, offsets, bag_shift, psw, bag_scale, ctx.pooled, ctx.batch_major
            )
            grads = torch.autograd.grad(out, [leaf, psw] if want_psw else [leaf], grad_out.to(out.dtype))
        rows = weight.size(0)
        touched = torch.zeros(rows, dtype=torch.float32, device=weight.device)
        touched.index_fill_(0, embedding_torch.buffer_rows(ids, offsets, bag_shift), 1.0)
        both = torch.cat([grads[0].reshape(-1), touched])
        if lookup.world_size > 1:
            dist.all_reduce(both, group=lookup.process_group)
        grad = both[: rows * weight.size(1)].view(rows, weight.size(1))
        if get_gradient_division() and lookup.world_size > 1:
            grad = grad.div_(lookup.world_size)
        updated = both[rows * weight.size(1) :].nonzero().squeeze(1)
        apply_rows_(weight, updated, grad.index_select(0, updated), lookup.optimizer.step_args())
        psw_grad = grads[1].to(weights.dtype) if want_psw else None
        return None, psw_grad, None, None, None, None, None, None, None


class ReplicatedFusedLookup(GroupedEmbeddingLookup):
    """A ``GroupedEmbeddingLookup`` of whole tables replicated on every rank of ``process_group``
    whose fused optimizer's update is all-reduced first (module doc). ``process_group`` /
    ``world_size`` are set by :class:`ReplicatedShardedLookup` after construction."""

    process_group: Optional[dist.ProcessGroup] = None
    world_size: int = 1

    def reset_parameters(self) -> None:
        """Initialize (``GroupedEmbeddingLookup``), then take rank 0's weights: the replicas must start
        equal, and no data-parallel wrapper broadcasts a FUSED replica (a collective once the group
        is set, as at ``DistributedModelParallel``'s initialization of meta tensors)."""
        super().reset_parameters()
        self.sync_replicas()

    @torch.no_grad()
    def sync_replicas(self) -> None:
        """Broadcast the buffer from the group's first rank (no-op before the group is set, and for
        a local environment without torch.distributed)."""
        if self.world_size > 1 and self.weight.device.type != "meta" and dist.is_initialized():
            dist.broadcast(self.weight.data, group_src=0, group=self.process_group)

    def _run_kernel(self, ids, offsets, bag_shift, weights, bag_scale, batch_major) -> torch.Tensor:
        if self.optimizer is None or not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super()._run_kernel(ids, offsets, bag_shift, weights, bag_scale, batch_major)
        return _ReplicatedFusedFn.apply(
            self.weight, weights, ids, offsets, bag_shift, bag_scale, self.pooled, batch_major, self
        )


class ReplicatedShardedLookup(ShardedGroupedLookup):
    """The data-parallel lookup of a FUSED-kernel sharding: :class:`ReplicatedFusedLookup` groups."""

    group_lookup_class = ReplicatedFusedLookup

    def set_group(self, process_group: Optional[dist.ProcessGroup], world_size: int) -> None:
        """Set the replicas' group and make them equal to its first rank's (a collective)."""
        for lookup in self.lookups:
            lookup.process_group, lookup.world_size = process_group, world_size
            lookup.sync_replicas()

    def load_tables(self, table_weight) -> None:
        """Copy the tables from ``table_weight`` (``ShardedGroupedLookup``), then take rank 0's copy:
        each rank's unsharded module may hold other values (a collective)."""
        super().load_tables(table_weight)
        for lookup in self.lookups:
            lookup.sync_replicas()


__all__ = ["ReplicatedFusedLookup", "ReplicatedShardedLookup"]
