"""The fused optimizer on data-parallel tables: every replica applies the same update in backward.

A data-parallel table is whole on every rank and each rank looks up its own samples. With the DENSE
kernel its gradient is averaged by the model's data-parallel wrapper and a dense optimizer steps it.
With the FUSED kernel (a collection that asks for a fused optimizer: its own, an in-backward one or
the sharder's ``fused_params``) this module's backward

1. computes this rank's gradient of the rows its ids touched (the gradient divided by the world
   size while ``get_gradient_division()``, as the other shardings' output dists divide theirs),
   straight into its block of the exchange's kept wire buffer: by a scatter in id order with no sort
   of the ids (:mod:`shardkit.kernels.replica_grad`: each row's sum is the fused backward's), or, for
   a table too large for the kept per-row marks, with the kernel backend's fused backward (an SGD
   step into the zeroed block of its sorted touched rows);
2. exchanges the ranks' row gradients (:mod:`shardkit.sharding.replicated_exchange`): every rank's
   touched rows and gradients by all-gather, or, when most rows are touched, one all-reduce of the
   dense gradient with touched flags and the ranks' counts, in a buffer reused across backwards;
3. sums each row's gradients and applies the fused optimizer's rule to it (the kernel backend's fused
   backward, ``shardkit.kernels.embedding_fused_backward``), on every rank alike,

so the replicas stay equal and take the step the unsharded module takes on the global batch (lazy
rules such as ADAM move only touched rows, as there). The weight gets no ``.grad``: it stays out of
the data-parallel wrapper (``ShardedEmbeddingModule.sharded_parameter_names``).
Cost per group of tables per backward: one gather of ``world x max touched x (dim + 2)`` 4-byte
words carrying the counts too (sized by the last exchange's counts; the first backward, a larger
table's and one that outgrows that size gather the counts or the rows once more), or one
all-reduce of ``rows x (dim + 1) + world`` fp32 values (what a dense table's gradient all-reduce
costs) once the last exchange's counts said most rows are touched
(every rank knows them alike: no collective to agree); every rank must run the backward. With
trainable per-sample weights the rows' gradient comes from torch autograd over a re-run of the
lookup on the touched rows (the kernels give that gradient only with an optimizer step), and the
exchange starts with the counts gather.

A rank's groups of tables of several widths run as one autograd node (:class:`_ReplicatedGroupsFn`):
the groups whose last exchange sized their gather make it as ONE all-gather, and those on the dense
way with buffers of at most ``JOINT_DENSE_BYTES`` as ONE all-reduce (the same words reach each group).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from shardkit.distributed.comm_ops import get_gradient_division
from shardkit.kernels import embedding_fused_backward, embedding_torch
from shardkit.kernels.replica_grad import grad_scatter
from shardkit.kernels.row_optimizer import RowOptimizerArgs
from shardkit.modules.fused_groups import FusedGroupsLookup
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup
from shardkit.modules.lookup_kernels import lookup_output
from shardkit.sharding.embedding_lookup import ShardedGroupedLookup
from shardkit.sharding.replicated_exchange import (
    JOINT_DENSE_BYTES,
    DenseRowExchange,
    GatherWire,
    GroupAllReduce,
    GroupGather,
    all_reduce_groups,
    gather_bound,
    gather_counts,
    gather_groups,
    prefers_dense,
    rows_of_all_ranks,
    uses_scratch,
)


class _ReplicatedFusedFn(torch.autograd.Function):
    """forward(weight [R, D], weights [N] or None, ids, offsets, bag_shift, bag_scale, pooled,
    batch_major, lookup) -> the lookup's output; backward: all-reduced rows update (module doc)."""

    @staticmethod
    def forward(ctx, weight, weights, ids, offsets, bag_shift, bag_scale, pooled, batch_major, lookup):
        ctx.weight = weight  # by reference: the backward updates it in place (as FusedLookup)
        ctx.lookup, ctx.pooled, ctx.batch_major = lookup, pooled, batch_major
        ctx.save_for_backward(ids, offsets, bag_shift, weights, bag_scale)
        return lookup_output(weight, ids, offsets, bag_shift, weights, bag_scale, pooled, batch_major)

    @staticmethod
    def backward(ctx, grad_out):
        ids, offsets, bag_shift, weights, bag_scale = ctx.saved_tensors
        lookup: ReplicatedFusedLookup = ctx.lookup
        weight = ctx.weight
        want_psw = weights is not None and ctx.needs_input_grad[1]
        step = lookup.optimizer.step_args()
        if lookup.world_size == 1:  # nothing to exchange: the unsharded module's fused backward
            psw_grad = embedding_fused_backward(
                weight,
                ids,
                offsets,
                bag_shift,
                weights,
                bag_scale,
                grad_out,
                ctx.pooled,
                step,
                want_psw,
                ctx.batch_major,
            )
            return None, None if psw_grad is None else psw_grad.to(weights.dtype), *([None] * 7)
        world = lookup.world_size
        args = (ids, offsets, bag_shift, weights, bag_scale, grad_out, ctx.pooled, ctx.batch_major)
        psw_grad = None
        if want_psw:
            rows, grad, psw_grad = _touched_grad_autograd(weight, *args, world)
        elif lookup.dense_next:  # the last exchange's counts: most rows touched, no counts gather
            exchange = lookup.dense_exchange(weight)
            fill = _dense_fill(args, world, dist.get_rank(lookup.process_group))
            lookup.step_replicas(exchange, weight, step, fill)
            return (None,) * 9
        else:
            _sparse_exchange(lookup, weight, args, world, step)
            return (None,) * 9
        counts = gather_counts(rows.numel(), rows.device, lookup.process_group, world)
        if prefers_dense(counts, weight.size(0), weight.size(1)):
            exchange = lookup.dense_exchange(weight)
            exchange.start()
            exchange.grad.index_copy_(0, rows, grad)
            exchange.mark(rows, dist.get_rank(lookup.process_group))
            lookup.step_replicas(exchange, weight, step)
        else:
            lookup.dense_next = False
            rows, grad = rows_of_all_ranks(rows, grad, counts, lookup.process_group)
            # the kernel backend sums each row's gradients in order (rank 0's first) and steps it once
            ends = torch.tensor([0, rows.numel()], dtype=torch.int64, device=rows.device)
            embedding_fused_backward(weight, rows, ends, None, None, None, grad, False, step)
        return None, None if psw_grad is None else psw_grad.to(weights.dtype), *([None] * 7)


class _ReplicatedGroupsFn(FusedGroupsLookup):
    """Several replicated groups' lookups as one autograd node (forward as :class:`FusedGroupsLookup`);
    backward: each group's update as :class:`_ReplicatedFusedFn`'s (no per-id weights' gradient: such
    lookups take each group alone), in the groups' order, with the sparse gathers of the groups whose
    last exchange set their size made as ONE all-gather (:func:`gather_groups`) and the dense ways of
    buffers up to ``JOINT_DENSE_BYTES`` as ONE all-reduce (:func:`all_reduce_groups`): the same words
    reach every group, so the same update, with one collective's fixed cost instead of one a group.
    Every rank takes the same ways in the same order: they follow from the last exchanges' counts,
    which every rank holds alike."""

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.lookups[0].world_size == 1:  # nothing to exchange: the unsharded module's fused backward
            return FusedGroupsLookup.backward(ctx, grad_out)
        joint, dense = [], []
        for lookup, x, grad in zip(ctx.lookups, ctx.inputs, grad_out.split(ctx.widths, dim=1)):
            weight, world = lookup.weight, lookup.world_size
            step = lookup.optimizer.step_args()
            args = (x.ids, x.offsets, x.bag_shift, x.weights, x.bag_scale, grad, True, x.batch_major)
            if lookup.dense_next:
                exchange = lookup.dense_exchange(weight)
                fill = _dense_fill(args, world, dist.get_rank(lookup.process_group))
                if 4 * exchange.words() <= JOINT_DENSE_BYTES:
                    dense.append((lookup, GroupAllReduce(exchange, weight, step, fill)))
                else:
                    lookup.step_replicas(exchange, weight, step, fill)
            elif lookup.next_gather_rows is None:  # its first exchange: the counts first
                _sparse_exchange(lookup, weight, args, world, step)
            else:
                exchange, rows, fill = _sparse_rows(lookup, weight, args, world)
                part = GroupGather(exchange, rows, lookup.next_gather_rows, fill)
                joint.append((lookup, weight, args, world, step, part))
        if len(dense) == 1:
            lookup, part = dense[0]
            lookup.step_replicas(part.exchange, part.weight, part.step, part.fill)
        elif dense:
            first = dense[0][0]
            parts = [part for _, part in dense]
            for (lookup, part), counts in zip(
                dense, all_reduce_groups(parts, first.process_group, first.wire("dense"))
            ):
                lookup.next_way(counts, part.weight)
        if len(joint) == 1:
            lookup, weight, args, world, step, part = joint[0]
            counts = part.exchange.gather(part.rows, part.most, lookup.process_group, part.fill)
            _finish_sparse(lookup, weight, args, world, step, part, counts)
        elif joint:
            first = joint[0][0]
            gathered = gather_groups([entry[5] for entry in joint], first.process_group, first.wire("gather"))
            for entry, (counts, blocks) in zip(joint, gathered):
                _finish_sparse(*entry, counts, blocks)
        return (None, None, *([None] * len(ctx.lookups)))


def _sparse_exchange(lookup, weight, args, world, step) -> None:
    """The sparse backward (no per-sample weights' gradient): this rank's distinct sorted touched
    rows, then one all-gather of every rank's count, rows and gradient rows in the kept wire buffer
    sized by the last exchange's counts (:func:`gather_bound`; the first backward gathers the counts
    first, and a rank touching more rows than that makes every rank gather again, sized to fit), this
    rank's rows' gradient written straight into its block of that buffer, and one fused step of the
    gathered rows reading them in place (:meth:`DenseRowExchange.step_gathered`); or, when the counts
    say most rows are touched, the gradient scattered into the dense buffer and the dense all-reduce.

    The touched rows: for a table that :func:`uses_scratch`, read off the kept exchange's marks (no
    sort of the ids, :func:`touched_rows`) with each id's target its row's position among them
    (:func:`grad_scatter`); for a larger one (whose 9 bytes a row of marks and positions are not
    kept), sorted by ``torch.unique`` and the gradient summed by the fused backward over the
    renumbered ids (:func:`_accumulate`). Either way no buffer of the touched rows' size is made
    per step: a fresh one over glibc's mmap threshold (32 MiB) costs page faults every step."""
    exchange, rows, fill = _sparse_rows(lookup, weight, args, world)
    most = lookup.next_gather_rows
    if most is None:  # no exchange yet: the counts first (they may say dense)
        counts = gather_counts(rows.numel(), rows.device, lookup.process_group, world)
        most = max(counts) if not prefers_dense(counts, weight.size(0), weight.size(1)) else -1
    if most >= 0:
        counts = exchange.gather(rows, most, lookup.process_group, fill)
    _finish_sparse(lookup, weight, args, world, step, GroupGather(exchange, rows, most, fill), counts)


def _sparse_rows(lookup, weight, args, world):
    """The sparse way's ``(exchange, rows, fill)``: the group's kept exchange, this rank's distinct
    sorted touched rows and the writer of their gradient into a ``[U, dim]`` view
    (:func:`_sparse_exchange`)."""
    ids, offsets, bag_shift, weights, bag_scale, grad_out, pooled, batch_major = args
    exchange = lookup.dense_exchange(weight)
    if uses_scratch(weight.size(0), weight.size(1), world):
        rows = exchange.touched(ids, offsets, bag_shift)

        def fill(out: torch.Tensor) -> None:
            seen = torch.zeros(out.size(0), dtype=torch.float32, device=out.device)
            factor, exact = _scale_and_lr(world)
            kernel_args = (ids, offsets, bag_shift, weights, bag_scale, grad_out, pooled, batch_major)
            grad_scatter(out, seen, *kernel_args, factor if exact else 1.0, exchange.position, weight.size(0))
            if not exact:
                out.div_(world)  # before the sum over the ranks, as the other shardings divide

    else:
        rows, local_ids = _sorted_rows(ids, offsets, bag_shift)

        def fill(out: torch.Tensor) -> None:
            out.zero_()  # the wire buffer's pages are kept: a memset, no page faults
            _accumulate(
                out, local_ids, offsets, None, weights, bag_scale, grad_out, pooled, batch_major, world
            )

    return exchange, rows, fill


def _finish_sparse(lookup, weight, args, world, step, part: GroupGather, counts, gathered=None) -> None:
    """After the gather of ``part`` (``counts``: every rank's count; ``gathered``: its blocks when a
    joint gather made them, :func:`gather_groups`, else the exchange's own): step the gathered rows,
    gathering again alone when a rank touched more rows than there was room for, or take the dense
    way when the counts say most rows are touched; then set the next backward's way."""
    exchange, rows, most, fill = part
    if not prefers_dense(counts, weight.size(0), weight.size(1)):
        if max(counts) > most:  # a rank touched more rows than there was room for: again, to fit
            exchange.gather(rows, max(counts), lookup.process_group, fill)
            gathered = None
        lookup.dense_next, lookup.next_gather_rows = False, gather_bound(counts)
        blocks = None if gathered is None else (gathered.reshape(-1), most)
        exchange.step_gathered(rows, counts, weight, step, blocks)
        return
    fill = _dense_fill(args, world, dist.get_rank(lookup.process_group))
    lookup.step_replicas(exchange, weight, step, fill)


def _dense_fill(args, world: int, rank: int):
    """The dense way's term of this rank, as :meth:`DenseRowExchange.all_reduce_and_step`'s ``fill``:
    its gradient of every buffer row (times its factor, :func:`_scale_and_lr`) scattered into
    ``grad`` in id order with no sort, its rows flagged and its count of them in its slot
    (:func:`grad_scatter`; no memset of the gradient: the scatter writes every row)."""

    def fill(grad: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor) -> None:
        factor, exact = _scale_and_lr(world)
        count = grad_scatter(grad, flags, *args, factor if exact else 1.0)
        if not exact:
            grad.div_(world)  # before the sum over the ranks, as the other shardings divide
        counts[rank] = count

    return fill


def _scale_and_lr(world: int) -> Tuple[float, bool]:
    """The factor of each rank's gradient (``1 / world`` while ``get_gradient_division()``, as the
    other shardings' output dists divide theirs) and whether the kernel may apply it: as its SGD
    step's ``-lr`` only when exact (a power of two), else the caller divides (as torch would)."""
    if not get_gradient_division():
        return 1.0, True
    return 1.0 / world, world & (world - 1) == 0


def _accumulate(
    buffer, ids, offsets, bag_shift, weights, bag_scale, grad_out, pooled, batch_major, world, divide=True
) -> bool:
    """Add this rank's gradient of each buffer row (times its factor, :func:`_scale_and_lr`) into
    ``buffer`` (fp32 ``[rows, D]``, zeros where untouched): the kernel backend's fused backward with
    an SGD step of ``lr = -factor``, which sums each row's ids in id order like the unsharded
    module's fused backward and makes nothing of the size of ``[N, D]``. Returns whether the factor
    was applied; when not (a world not a power of two) and not ``divide``, the caller divides."""
    factor, exact = _scale_and_lr(world)
    sgd = RowOptimizerArgs("SGD", lr=-(factor if exact else 1.0))
    embedding_fused_backward(
        buffer, ids, offsets, bag_shift, weights, bag_scale, grad_out, pooled, sgd, False, batch_major
    )
    if not exact and divide:
        buffer.div_(world)  # before the sum over the ranks, as the other shardings divide
    return exact or divide


def _sorted_rows(ids, offsets, bag_shift) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's distinct sorted touched buffer rows (int64 ``[U]``) and each id renumbered into
    them (int64 ``[N]``), by ``torch.unique``: nothing of the size of the table is made."""
    return torch.unique(embedding_torch.buffer_rows(ids, offsets, bag_shift), return_inverse=True)


def _touched_grad_autograd(
    weight, ids, offsets, bag_shift, weights, bag_scale, grad_out, pooled, batch_major, world
):
    """This rank's distinct sorted touched buffer rows (int64 ``[U]``), their gradient (fp32
    ``[U, D]``, already divided, :func:`_scale_and_lr`) and the per-sample weights' gradient (fp32
    ``[N]``, against the rows before the update), by torch autograd over a re-run of the lookup on
    the touched rows (the kernels give the per-sample weights' gradient only together with an
    optimizer step)."""
    touched, local_ids = torch.unique(
        embedding_torch.buffer_rows(ids, offsets, bag_shift), return_inverse=True
    )
    with torch.enable_grad():
        leaf = weight.detach().index_select(0, touched).to(torch.float32).requires_grad_()
        psw = weights.detach().requires_grad_()
        out = embedding_torch.embedding_forward(
            leaf, local_ids, offsets, None, psw, bag_scale, pooled, batch_major
        )
        grad, psw_grad = torch.autograd.grad(out, [leaf, psw], grad_out.to(out.dtype))
    factor, _ = _scale_and_lr(world)
    if factor != 1.0:
        grad = grad.div_(world)  # before the sum: exact for a world of a power of two
    return touched, grad, psw_grad


class ReplicatedFusedLookup(GroupedEmbeddingLookup):
    """A ``GroupedEmbeddingLookup`` of whole tables replicated on every rank of ``process_group``
    whose fused optimizer's update is all-reduced first (module doc). ``process_group`` /
    ``world_size`` are set by :class:`ReplicatedShardedLookup` after construction."""

    process_group: Optional[dist.ProcessGroup] = None
    world_size: int = 1
    # whether the next backward takes the dense exchange: set from the last exchange's counts, which
    # every rank of the group holds alike (so all take the same way, with no collective to agree)
    dense_next: bool = False
    # the rows per rank the next sparse gather makes room for (gather_bound of the last exchange's
    # counts, alike on every rank); None: no exchange yet, gather the counts first
    next_gather_rows: Optional[int] = None
    _dense_exchange: Optional[DenseRowExchange] = None
    _wires: Optional[Dict[str, GatherWire]] = None

    def wire(self, name: str) -> GatherWire:
        """The kept buffer ``name`` (``"gather"``, ``"dense"``) of the joint collectives this group makes
        for its lookup's groups (the first of them, :class:`_ReplicatedGroupsFn`)."""
        if self._wires is None:
            self._wires = {}
        return self._wires.setdefault(name, GatherWire())

    def dense_exchange(self, weight: torch.Tensor) -> DenseRowExchange:
        """The reused buffer of the dense exchange for ``weight`` (made on first use)."""
        sizes = (weight.size(0), weight.size(1), self.world_size, weight.device)
        if self._dense_exchange is None or not self._dense_exchange.fits(*sizes):
            self._dense_exchange = DenseRowExchange(*sizes)
        return self._dense_exchange

    def step_replicas(self, exchange: DenseRowExchange, weight: torch.Tensor, step, fill=None) -> None:
        """All-reduce the dense exchange (this rank's term written by ``fill`` when given, see
        :meth:`DenseRowExchange.all_reduce_and_step`), step the touched rows, and pick the next
        backward's way from the counts it carried."""
        self.next_way(exchange.all_reduce_and_step(weight, step, self.process_group, fill), weight)

    def next_way(self, counts: List[int], weight: torch.Tensor) -> None:
        """The next backward's way from a dense exchange's ``counts`` (every rank's, alike)."""
        self.dense_next = prefers_dense(counts, weight.size(0), weight.size(1))
        self.next_gather_rows = gather_bound(counts)

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

    def _run_kernel(self, ids, offsets, bag_shift, weights, bag_scale, batch_major, out=None) -> torch.Tensor:
        if (
            out is not None
            or self.optimizer is None
            or not (torch.is_grad_enabled() and self.weight.requires_grad)
        ):
            return super()._run_kernel(ids, offsets, bag_shift, weights, bag_scale, batch_major, out)
        return _ReplicatedFusedFn.apply(
            self.weight, weights, ids, offsets, bag_shift, bag_scale, self.pooled, batch_major, self
        )


class ReplicatedShardedLookup(ShardedGroupedLookup):
    """The data-parallel lookup of a FUSED-kernel sharding: :class:`ReplicatedFusedLookup` groups."""

    group_lookup_class = ReplicatedFusedLookup
    groups_function = _ReplicatedGroupsFn

    def set_group(self, process_group: Optional[dist.ProcessGroup], world_size: int) -> None:
        """Set the replicas' group and make them equal to its first rank's (a collective)."""
        for lookup in self.lookups:
            lookup.process_group, lookup.world_size = process_group, world_size
            lookup.dense_next, lookup._dense_exchange, lookup.next_gather_rows = False, None, None
            lookup.sync_replicas()

    def load_tables(self, table_weight) -> None:
        """Copy the tables from ``table_weight`` (``ShardedGroupedLookup``), then take rank 0's copy:
        each rank's unsharded module may hold other values (a collective)."""
        super().load_tables(table_weight)
        for lookup in self.lookups:
            lookup.sync_replicas()


__all__ = ["ReplicatedFusedLookup", "ReplicatedShardedLookup"]
