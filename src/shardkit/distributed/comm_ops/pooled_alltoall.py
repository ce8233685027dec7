"""The pooled all-to-all comm op (table-/column-wise output dist): ``alltoall_pooled`` and its placed
form, which writes the received columns straight into the module's order (``ColumnPlacement``), with
the plans a caller may keep across steps while validation is off.

Differentiable with an all-to-all of the gradients, the send and receive sizes swapped, as its
backward. Sizes below: ``W`` ranks, this rank ``me``, ``B_r`` rank ``r``'s batch size, ``D_r`` the
embedding columns rank ``r`` computes.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_rank
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.comm_ops import in_place, scratch
from shardkit.distributed.comm_ops.exchange import (
    Layout,
    agree_values,
    all_to_all,
    all_to_all_consumed,
    all_to_all_flat,
    all_to_all_flat_consumed,
    backward_codec,
    check_sizes,
    checked_plan,
    forward_codec,
    join,
    world_of,
)
from shardkit.distributed.comm_ops.infos import All2AllPooledInfo
from shardkit.distributed.comm_ops.placement import ColumnPlacement
from shardkit.distributed.comm_ops.request import CommPlan, Request, get_gradient_division, start_request
from shardkit.distributed.validation import validation_enabled

ProcessGroup = dist.ProcessGroup


# a caller's reused plans (see _alltoall_pooled): sizes, shape, dtype, gradient division -> plan
PlanCache = Dict[tuple, "_PooledPlan"]
PLAN_CACHE_LIMIT = 16


class _PooledPlan(CommPlan):
    """Input ``[sum_r B_r, D_me]`` -> output ``[B_me, sum_r D_r]``: rows go to their samples' ranks.

    With a ``placement``, the received column blocks go straight to their places in the output (and
    the gradient's blocks straight into the send buffer) instead of in rank order.
    """

    def __init__(
        self,
        info: All2AllPooledInfo,
        world: int,
        rank: int,
        group,
        dtype: torch.dtype,
        placement: Optional[ColumnPlacement] = None,
    ) -> None:
        super().__init__(world, info)
        self.rank, self.group, self.dtype = rank, group, dtype
        self.placement = placement
        batch, dims = info.batch_size_per_rank, info.dim_sum_per_rank
        # elements sent to / received from each rank, worked out once (both passes read them)
        self._send = tuple(b * dims[rank] for b in batch)
        self._recv = tuple(batch[rank] * d for d in dims)

    def layout(self) -> Layout:
        return Layout(self._send, self._recv, agree_values(self.dtype, self.info.codecs))

    def start_forward(self, inputs):
        batch, dims = self.info.batch_size_per_rank, self.info.dim_sum_per_rank
        b_me = batch[self.rank]
        codec = forward_codec(self.info.codecs)
        if self.placement is not None:
            placement = self.placement

            def assemble(pieces):
                return placement.assemble(pieces, b_me)
        else:

            def assemble(pieces):
                out = scratch.empty((b_me, sum(dims)), pieces[0].dtype, pieces[0].device)
                return torch.cat([p.view(b_me, d) for p, d in zip(pieces, dims)], dim=1, out=out)

        if self.placement is not None and codec is None and inputs[0].is_contiguous():
            placed = in_place.pooled_placed_forward(inputs[0], batch, self.placement, self.rank, self.group)
            if placed is not None:  # through shared memory, written and read in place
                return placed
        # both copy the pieces into an output of comm_ops.scratch: the receive buffer is then free
        if codec is None and inputs[0].is_contiguous():
            # the [B_r, D_me] row chunks tile the input in order: send it as it is
            return all_to_all_flat_consumed(
                inputs[0].view(-1), self._send, self._recv, self.group, self.world, assemble
            )
        chunks = inputs[0].split(batch, dim=0)  # [B_r, D_me] rows: contiguous, sent without a copy
        return all_to_all_consumed(chunks, self._recv, self.dtype, codec, self.group, assemble)

    def start_backward(self, grads):
        batch, dims = self.info.batch_size_per_rank, self.info.dim_sum_per_rank
        d_me = dims[self.rank]
        rows = sum(batch)
        codec = backward_codec(self.info.codecs)
        if self.placement is not None:
            grad = grads[0]
            if codec is None:
                # through shared memory, written and read in place, the gradient division in the copies
                divisor = self.world if self.divide else 1
                placed = in_place.pooled_placed_backward(
                    grad, batch, self.placement, self.rank, self.group, divisor
                )
                if placed is not None:
                    return placed
                # the blocks land back to back in one buffer (comm_ops.scratch), sent as it is
                flat = self.placement.split_flat(grad)
                received = all_to_all_flat(flat, self._recv, self._send, self.group, self.world)
                return received.then(lambda out: (out.view(rows, d_me),))
            chunks = self.placement.split(grad)  # back to back in one buffer: sent as they are
        else:
            chunks = grads[0].split(dims, dim=1)  # [B_me, D_r] column blocks, back to their owners
        received = all_to_all(chunks, self._send, self.dtype, codec, self.group)

        return received.then(lambda pieces: (join(pieces).view(rows, d_me),))


def alltoall_pooled(
    a2a_pooled_embs_tensor: torch.Tensor,
    batch_size_per_rank: list[int],
    dim_sum_per_rank: list[int],
    dim_sum_per_rank_tensor: Optional[torch.Tensor] = None,
    cumsum_dim_sum_per_rank_tensor: Optional[torch.Tensor] = None,
    group: Optional[ProcessGroup] = None,
    codecs: Optional[QuantizedCommCodecs] = None,
) -> Request[torch.Tensor]:
    """All-to-all of pooled embeddings: ``[sum_r B_r, D_me]`` -> ``Awaitable`` of ``[B_me, sum_r D_r]``.

    Rank ``me`` computed ``D_me = dim_sum_per_rank[me]`` columns for the whole global batch; rank
    ``r`` receives the rows of its ``B_r = batch_size_per_rank[r]`` samples from every rank and
    concatenates them along columns in rank order. Any dtype; the output keeps it. Backward: the
    gradient's column blocks go back to their owners (all-to-all with swapped sizes), divided by
    ``W`` when gradient division is on. ``dim_sum_per_rank_tensor`` / ``cumsum_dim_sum_per_rank_tensor``
    are kept in the info only (no fused kernel needs them). Saved for backward: the sizes (ints).
    """
    return _alltoall_pooled(
        a2a_pooled_embs_tensor,
        batch_size_per_rank,
        dim_sum_per_rank,
        dim_sum_per_rank_tensor,
        cumsum_dim_sum_per_rank_tensor,
        group,
        codecs,
    )


def alltoall_pooled_placed(
    a2a_pooled_embs_tensor: torch.Tensor,
    batch_size_per_rank: list[int],
    placement: ColumnPlacement,
    group: Optional[ProcessGroup] = None,
    codecs: Optional[QuantizedCommCodecs] = None,
    plans: Optional[PlanCache] = None,
) -> Request[torch.Tensor]:
    """``alltoall_pooled`` whose output columns are ordered by ``placement`` (rank ``r`` computes
    ``placement.columns(r)`` columns): the result is that of ``alltoall_pooled`` followed by the
    column permutation, bitwise, with one copy fewer each way. ``plans``: see :func:`_alltoall_pooled`."""
    world = world_of(group)
    if len(placement.dest) != world:  # the plan's, so the same verdict on every rank
        raise ValueError(
            f"alltoall_pooled_placed: the placement has {len(placement.dest)} ranks, the group {world}"
        )
    dims = [placement.columns(r) for r in range(world)]
    return _alltoall_pooled(
        a2a_pooled_embs_tensor, batch_size_per_rank, dims, None, None, group, codecs, placement, plans
    )


def _alltoall_pooled(
    x: torch.Tensor,
    batch_size_per_rank: list[int],
    dim_sum_per_rank: list[int],
    dim_sum_per_rank_tensor: Optional[torch.Tensor],
    cumsum_dim_sum_per_rank_tensor: Optional[torch.Tensor],
    group: Optional[ProcessGroup],
    codecs: Optional[QuantizedCommCodecs],
    placement: Optional[ColumnPlacement] = None,
    plans: Optional[PlanCache] = None,
) -> Request[torch.Tensor]:
    """``plans``: a caller's cache (one per output dist) of the plans it built, reused while
    validation is off: a training step repeats the same sizes every step, and with validation off a
    plan is only the sizes worked out and checked locally, so the same plan serves again (its checks
    passed for these very sizes). With validation on, every call checks its sizes against the other
    ranks' and builds its plan. The plan's ``info`` is then shared by the requests that reuse it."""
    key = None
    if (
        plans is not None
        and dim_sum_per_rank_tensor is None
        and cumsum_dim_sum_per_rank_tensor is None
        and all(type(n) is int for n in batch_size_per_rank)
        and all(type(n) is int for n in dim_sum_per_rank)
        and not validation_enabled()
    ):
        key = (
            tuple(batch_size_per_rank),
            tuple(dim_sum_per_rank),
            tuple(x.shape),
            x.dtype,
            get_gradient_division(),
        )
        cached = plans.get(key)
        # the objects compared by identity: a cache is its caller's, which keeps them, but a caller
        # may still pass another group, codecs or placement
        if (
            cached is not None
            and cached.group is group
            and cached.info.codecs is codecs
            and cached.placement is placement
        ):
            return start_request(cached, group, (x,))
    world, rank = world_of(group), group_rank(group)
    info = All2AllPooledInfo(
        batch_size_per_rank=list(batch_size_per_rank),
        dim_sum_per_rank=list(dim_sum_per_rank),
        dim_sum_per_rank_tensor=dim_sum_per_rank_tensor,
        cumsum_dim_sum_per_rank_tensor=cumsum_dim_sum_per_rank_tensor,
        codecs=codecs,
    )

    def build() -> _PooledPlan:
        info.batch_size_per_rank = check_sizes("batch_size_per_rank", batch_size_per_rank, world, rank)
        info.dim_sum_per_rank = check_sizes("dim_sum_per_rank", dim_sum_per_rank, world, rank)
        expected = (sum(info.batch_size_per_rank), info.dim_sum_per_rank[rank])
        if x.dim() != 2 or tuple(x.shape) != expected:  # the message formatted only on failure
            raise ValueError(
                f"alltoall_pooled on rank {rank}: input of shape {tuple(x.shape)}, expected "
                f"[sum(batch_size_per_rank), dim_sum_per_rank[{rank}]] = {list(expected)}"
            )
        return _PooledPlan(info, world, rank, group, x.dtype, placement)

    plan = checked_plan("alltoall_pooled", group, build, _PooledPlan.layout)
    if key is not None:
        if len(plans) >= PLAN_CACHE_LIMIT:  # sizes that keep changing (uneven batches): stay bounded
            plans.clear()
        plans[key] = plan
    return start_request(plan, group, (x,))
