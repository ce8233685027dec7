"""The fused optimizer on data-parallel tables: every replica applies the same update in backward.

A data-parallel table is whole on every rank and each rank looks up its own samples. With the DENSE
kernel its gradient is averaged by the model's data-parallel wrapper and a dense optimizer steps it.
With the FUSED kernel (a collection that asks for a fused optimizer: its own, an in-backward one or
the sharder's ``fused_params``) this module's backward

1. computes this rank's gradient of the rows its ids touched (fp32 ``[touched, dim]``);
2. gathers every rank's touched rows and gradients (:func:`rows_of_all_ranks`; the gradient divided
   by the world size while ``get_gradient_division()``, as the other shardings' output dists divide
   theirs);
3. sums each row's gradients and applies the fused optimizer's rule to it (the kernel backend's fused
   backward, ``shardkit.kernels.embedding_fused_backward``), on every rank alike,

so the replicas stay equal and take the step the unsharded module takes on the global batch (lazy
rules such as ADAM move only touched rows, as there). The weight gets no ``.grad``: it stays out of
the data-parallel wrapper (``ShardedEmbeddingModule.sharded_parameter_names``).
Cost per group of tables per backward: two all-gathers (the counts, then ``world x max touched x
(dim + 2)`` 4-byte words), or, when most rows are touched, one all-reduce of ``rows x (dim + 1)``
fp32 values (what a dense table's gradient all-reduce costs); every rank must run the backward.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import all_gather_flat
from shardkit.distributed.comm_ops import get_gradient_division
from shardkit.kernels import embedding_forward, embedding_fused_backward, embedding_torch
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
        # this rank's touched rows (sorted) and the gradient of each: the lookup re-run on those rows
        # only (ids renumbered into them), so nothing of the size of the table is made
        touched, local_ids = torch.unique(
            embedding_torch.buffer_rows(ids, offsets, bag_shift), return_inverse=True
        )
        with torch.enable_grad():
            # the rows' values matter to the per-sample weights' gradient only (the rows' gradient is
            # linear in grad_out): zeros otherwise, not a gather
            if want_psw:
                leaf = weight.detach().index_select(0, touched).to(torch.float32).requires_grad_()
            else:
                leaf = torch.zeros(touched.numel(), weight.size(1), device=weight.device, requires_grad=True)
            psw = None if weights is None else weights.detach().requires_grad_(want_psw)
            out = embedding_torch.embedding_forward(
                leaf, local_ids, offsets, None, psw, bag_scale, ctx.pooled, ctx.batch_major
            )
            grads = torch.autograd.grad(out, [leaf, psw] if want_psw else [leaf], grad_out.to(out.dtype))
        rows, grad = touched, grads[0]
        if lookup.world_size > 1:
            group, world = lookup.process_group, lookup.world_size
            if get_gradient_division():
                grad = grad.div_(world)  # before the sum: exact for a world of a power of two
            rows, grad = rows_of_all_ranks(touched, grad, weight.size(0), group, world)
        # the kernel backend sums each row's gradients in order (rank 0's first) and steps it once
        ends = torch.tensor([0, rows.numel()], dtype=torch.int64, device=rows.device)
        step = lookup.optimizer.step_args()
        embedding_fused_backward(weight, rows, ends, None, None, None, grad, False, step)
        psw_grad = grads[1].to(weights.dtype) if want_psw else None
        return None, psw_grad, None, None, None, None, None, None, None


def rows_of_all_ranks(
    rows: torch.Tensor, grad: torch.Tensor, num_rows: int, group: Optional[dist.ProcessGroup], world_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every rank's sparse row gradients, for each rank to sum: ``(rows int64 [K], grad fp32 [K, D])``,
    rank 0's rows first (a row appears once per rank that sent it), from this rank's distinct sorted
    ``rows`` ``[U]`` and ``grad`` ``[U, D]``. Equal on every rank.

    Two all-gathers: the ranks' counts (one int64 each), then every rank's rows and gradient rows in
    one int32 buffer padded to the largest count (a row as two int32 words, fp32 bits as one), so a step
    moves ``world x max(U) x (D + 2)`` words instead of the table's ``rows x (D + 1)``. When that is
    not fewer (most rows touched), one all-reduce of the dense ``[rows, D + 1]`` gradient and touched
    flags instead; every rank sees the same counts, so all take the same branch."""
    dim = grad.size(1)
    counts = torch.empty(world_size, dtype=torch.int64, device=grad.device)
    all_gather_flat(counts, torch.tensor([rows.numel()], dtype=torch.int64, device=grad.device), group=group)
    counts_list = counts.tolist()
    most = max(counts_list)
    if world_size * most * (dim + 2) >= num_rows * (dim + 1):
        both = torch.zeros(num_rows, dim + 1, dtype=torch.float32, device=grad.device)
        both[rows, :dim] = grad
        both[rows, dim] = 1.0
        dist.all_reduce(both, group=group)
        summed_rows = both[:, dim].nonzero().squeeze(1)
        return summed_rows, both[:, :dim].index_select(0, summed_rows)
    if most == 0:
        return rows, grad
    # per rank: [2 x most] int32 words of rows, then [most x dim] words of gradient, each padded
    count = rows.numel()
    send = torch.zeros(most * (dim + 2), dtype=torch.int32, device=grad.device)
    send[: 2 * count] = rows.view(torch.int32)
    send[2 * most : 2 * most + count * dim] = grad.reshape(-1).view(torch.int32)
    got = torch.empty(world_size, most * (dim + 2), dtype=torch.int32, device=grad.device)
    all_gather_flat(got.view(-1), send, group=group)
    got_rows = torch.cat([got[r, : 2 * c] for r, c in enumerate(counts_list)]).view(torch.int64)
    got_grad = torch.cat([got[r, 2 * most : 2 * most + c * dim] for r, c in enumerate(counts_list)])
    return got_rows, got_grad.view(torch.float32).view(-1, dim)


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
