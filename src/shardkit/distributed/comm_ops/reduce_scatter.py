"""Reduce-scatter comm ops and their dual, the all-gather comm op.

The backward of a reduce-scatter is an all-gather of the gradients, and the backward of an all-gather
a reduce-scatter. With gradient division on, both divide the input gradient by the world size ``W``.
Every rank must pass inputs of the same size (checked on every rank when validation is on).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_rank
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.comm_ops import in_place
from shardkit.distributed.comm_ops.exchange import (
    Layout,
    agree_values,
    all_gather,
    backward_codec,
    check_local,
    check_sizes,
    checked_plan,
    forward_codec,
    join,
    reduce_scatter,
    world_of,
)
from shardkit.distributed.comm_ops.infos import (
    AllGatherBaseInfo,
    ReduceScatterBaseInfo,
    ReduceScatterInfo,
    ReduceScatterVInfo,
)
from shardkit.distributed.comm_ops.request import CommPlan, Request, start_request

ProcessGroup = dist.ProcessGroup


class _RowsPlan(CommPlan):
    """Reduce-scatter along dim 0: rank ``r`` gets the sum of every rank's ``row_splits[r]`` rows.

    Input ``[n, *rest]`` -> ``[row_splits[me], *rest]``; backward all-gathers the gradient blocks and
    concatenates them back to ``[n, *rest]``. ``info``: a ``ReduceScatterBaseInfo`` or ``ReduceScatterVInfo``.
    """

    def __init__(self, info, shape, row_splits: list[int], world, rank, group, dtype, agree) -> None:
        super().__init__(world, info)
        self.shape, self.row_splits, self.rank = tuple(shape), row_splits, rank
        self.group, self.dtype, self._agree = group, dtype, agree

    def _numels(self) -> list[int]:
        row = math.prod(self.shape[1:])
        return [n * row for n in self.row_splits]

    def layout(self) -> Layout:
        numels = self._numels()
        return Layout(tuple(numels), (numels[self.rank],) * self.world, self._agree)

    def start_forward(self, inputs):
        chunks = inputs[0].split(self.row_splits, dim=0)
        out_shape = (self.row_splits[self.rank], *self.shape[1:])
        summed = reduce_scatter(chunks, self.dtype, forward_codec(self.info.codecs), self.group)
        return summed.then(lambda flat: flat.view(out_shape))

    def start_backward(self, grads):
        codec = backward_codec(self.info.codecs)
        numels = self._numels()
        if codec is None and self.world > 1 and grads[0].dtype == self.dtype:
            # through shared memory, the gradient division in its copies
            divisor = self.world if self.divide else 1
            shared = in_place.all_gather_shared(grads[0], numels, self.dtype, self.rank, self.group, divisor)
            if shared is not None:
                return shared.then(lambda pieces: (join(pieces).view(self.shape),))
        gathered = all_gather(grads[0], numels, self.dtype, codec, self.group)
        return gathered.then(lambda pieces: (join(pieces).view(self.shape),))


def _rows_request(what: str, x: torch.Tensor, group, build, agree) -> Request[torch.Tensor]:
    """Check ``build() -> (info, row_splits)`` across ranks and start the reduce-scatter of ``x``'s rows."""
    world, rank = world_of(group), group_rank(group)

    def plan() -> _RowsPlan:
        info, splits = build()
        return _RowsPlan(info, x.shape, splits, world, rank, group, x.dtype, agree)

    return start_request(checked_plan(what, group, plan, _RowsPlan.layout), group, (x,))


def _v_info(x: torch.Tensor, splits: list[int], codecs) -> ReduceScatterVInfo:
    rest = list(x.shape[1:])
    return ReduceScatterVInfo(
        input_sizes=[[n, *rest] for n in splits],
        input_splits=splits,
        equal_splits=len(set(splits)) == 1,
        total_input_size=list(x.shape),
        codecs=codecs,
    )


def reduce_scatter_base_pooled(
    input: torch.Tensor,
    group: Optional[ProcessGroup] = None,
    codecs: Optional[QuantizedCommCodecs] = None,
) -> Request[torch.Tensor]:
    """Sum over ranks, keep this rank's block of rows: ``[W * n, *rest]`` -> ``Awaitable`` of ``[n, *rest]``.

    The input is the same shape on every rank; rank ``r`` gets rows ``[r * n, (r + 1) * n)`` of the
    sum. Backward: all-gather of the gradient. Saved for backward: the input's shape.
    """
    world, rank = world_of(group), group_rank(group)

    def build() -> tuple[ReduceScatterBaseInfo, list[int]]:
        check_local(
            input.dim() >= 1 and input.size(0) % world == 0,
            f"reduce_scatter_base_pooled on rank {rank}: input of shape {tuple(input.shape)} has a "
            f"dim 0 that {world} ranks do not divide",
        )
        return ReduceScatterBaseInfo(input.shape, codecs), [input.size(0) // world] * world

    agree = agree_values(input.dtype, codecs, ("input shape", tuple(input.shape)))
    return _rows_request("reduce_scatter_base_pooled", input, group, build, agree)


def reduce_scatter_v_pooled(
    input: torch.Tensor,
    input_splits: list[int],
    group: Optional[ProcessGroup] = None,
    codecs: Optional[QuantizedCommCodecs] = None,
) -> Request[torch.Tensor]:
    """Sum, keep own rows: ``[sum(input_splits), *rest]`` -> ``Awaitable[[input_splits[me], ...]]``.

    ``input_splits[r]`` rows (the same list on every rank) go to rank ``r``. Backward: all-gather of
    the gradient blocks. Saved for backward: the splits and the input's shape.
    """
    world, rank = world_of(group), group_rank(group)

    def build() -> tuple[ReduceScatterVInfo, list[int]]:
        splits = check_sizes("input_splits", input_splits, world, rank)
        check_local(
            input.dim() >= 1 and sum(splits) == input.size(0),
            f"reduce_scatter_v_pooled on rank {rank}: input_splits {splits} sum to {sum(splits)}, "
            f"but the input has shape {tuple(input.shape)}",
        )
        return _v_info(input, splits, codecs), splits

    agree = agree_values(
        input.dtype, codecs, ("input shape", tuple(input.shape)), ("input_splits", tuple(input_splits))
    )
    return _rows_request("reduce_scatter_v_pooled", input, group, build, agree)


def reduce_scatter_v_per_feature_pooled(
    input: torch.Tensor,
    batch_size_per_rank_per_feature: list[list[int]],
    embedding_dims: list[int],
    group: Optional[ProcessGroup] = None,
    codecs: Optional[QuantizedCommCodecs] = None,
) -> Request[torch.Tensor]:
    """Reduce-scatter of a 1-D tensor of blocks with per-feature batch sizes -> ``Awaitable`` of 1-D.

    Rank ``r``'s block has ``sum_f batch_size_per_rank_per_feature[r][f] * embedding_dims[f]``
    elements, blocks in rank order; rank ``r`` gets the sum over ranks of its block. Backward:
    all-gather of the gradient blocks. Saved for backward: the block sizes.
    """
    world, rank = world_of(group), group_rank(group)
    batches = [list(b) for b in batch_size_per_rank_per_feature]
    dims = list(embedding_dims)

    def build() -> tuple[ReduceScatterVInfo, list[int]]:
        what = f"reduce_scatter_v_per_feature_pooled on rank {rank}"
        check_local(input.dim() == 1, f"{what}: input must be 1-D, got shape {tuple(input.shape)}")
        check_local(
            len(batches) == world and all(len(b) == len(dims) for b in batches),
            f"{what}: batch_size_per_rank_per_feature must be [{world} ranks][{len(dims)} features], "
            f"got {batches}",
        )
        splits = [sum(b * d for b, d in zip(batches[r], dims)) for r in range(world)]
        check_local(
            sum(splits) == input.numel(),
            f"{what}: the batch sizes and dims give {sum(splits)} elements, the input has {input.numel()}",
        )
        return _v_info(input, splits, codecs), splits

    agree = agree_values(
        input.dtype, codecs, ("input shape", tuple(input.shape)), ("batch sizes", batches), ("dims", dims)
    )
    return _rows_request("reduce_scatter_v_per_feature_pooled", input, group, build, agree)


class _ListPlan(CommPlan):
    """``inputs[r]`` (one tensor per rank, any shapes) -> the sum over ranks of ``inputs[me]``."""

    def __init__(self, info: ReduceScatterInfo, world, rank, group, dtype) -> None:
        super().__init__(world, info)
        self.rank, self.group, self.dtype = rank, group, dtype

    def layout(self) -> Layout:
        numels = [math.prod(size) for size in self.info.input_sizes]
        shapes = ("input sizes", tuple(tuple(size) for size in self.info.input_sizes))
        return Layout(
            tuple(numels),
            (numels[self.rank],) * self.world,
            agree_values(self.dtype, self.info.codecs, shapes),
        )

    def start_forward(self, inputs):
        own = self.info.input_sizes[self.rank]
        summed = reduce_scatter(inputs, self.dtype, forward_codec(self.info.codecs), self.group)
        return summed.then(lambda flat: flat.view(own))

    def start_backward(self, grads):
        sizes = self.info.input_sizes
        numels = [math.prod(size) for size in sizes]
        gathered = all_gather(grads[0], numels, self.dtype, backward_codec(self.info.codecs), self.group)
        return gathered.then(lambda pieces: tuple(p.view(size) for p, size in zip(pieces, sizes)))


def reduce_scatter_pooled(
    inputs: Sequence[torch.Tensor],
    group: Optional[ProcessGroup] = None,
    codecs: Optional[QuantizedCommCodecs] = None,
) -> Request[torch.Tensor]:
    """Reduce-scatter of a list: every rank's ``inputs[r]`` summed on rank ``r`` -> ``Awaitable`` of that sum.

    ``inputs`` has ``W`` tensors of one dtype; their shapes may differ from each other but must be the
    same list on every rank. Backward: all-gather of the gradient, one gradient per input.
    Saved for backward: the input sizes.
    """
    world, rank = world_of(group), group_rank(group)
    inputs = list(inputs)

    def build() -> _ListPlan:
        what = f"reduce_scatter_pooled on rank {rank}"
        check_local(len(inputs) == world, f"{what}: got {len(inputs)} inputs for a group of {world} ranks")
        check_local(
            len({t.dtype for t in inputs}) == 1,
            f"{what}: inputs have different dtypes {[t.dtype for t in inputs]}",
        )
        info = ReduceScatterInfo(input_sizes=[t.shape for t in inputs], codecs=codecs)
        return _ListPlan(info, world, rank, group, inputs[0].dtype)

    plan = checked_plan("reduce_scatter_pooled", group, build, _ListPlan.layout)
    return start_request(plan, group, tuple(inputs))


class _GatherPlan(CommPlan):
    """``[n, *rest]`` on every rank -> ``[W * n, *rest]``, rank blocks in rank order."""

    def __init__(self, info: AllGatherBaseInfo, world, group, dtype) -> None:
        super().__init__(world, info)
        self.group, self.dtype = group, dtype

    def layout(self) -> Layout:
        numel = (math.prod(self.info.input_size),) * self.world
        return Layout(
            numel,
            numel,
            agree_values(self.dtype, self.info.codecs, ("input shape", tuple(self.info.input_size))),
        )

    def start_forward(self, inputs):
        size = self.info.input_size
        numels = [math.prod(size)] * self.world
        gathered = all_gather(inputs[0], numels, self.dtype, forward_codec(self.info.codecs), self.group)
        return gathered.then(lambda pieces: join(pieces).view(self.world * size[0], *size[1:]))

    def start_backward(self, grads):
        size = self.info.input_size
        chunks = grads[0].split(size[0], dim=0)
        summed = reduce_scatter(chunks, self.dtype, backward_codec(self.info.codecs), self.group)
        return summed.then(lambda flat: (flat.view(size),))


def all_gather_base_pooled(
    input: torch.Tensor,
    group: Optional[ProcessGroup] = None,
    codecs: Optional[QuantizedCommCodecs] = None,
) -> Request[torch.Tensor]:
    """All-gather along dim 0: ``[n, *rest]`` (same on every rank) -> ``Awaitable`` of ``[W * n, *rest]``.

    Backward: reduce-scatter of the gradient (each rank's block summed over ranks, as every rank
    used the gathered tensor for its own work). Saved for backward: the input's shape.
    """
    world, rank = world_of(group), group_rank(group)

    def build() -> _GatherPlan:
        check_local(
            input.dim() >= 1,
            f"all_gather_base_pooled on rank {rank}: input must have a dimension, got a 0-d tensor",
        )
        return _GatherPlan(
            AllGatherBaseInfo(input_size=input.shape, codecs=codecs), world, group, input.dtype
        )

    plan = checked_plan("all_gather_base_pooled", group, build, _GatherPlan.layout)
    return start_request(plan, group, (input,))
