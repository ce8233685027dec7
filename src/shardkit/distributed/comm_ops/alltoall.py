"""All-to-all comm ops: variable-batch pooled, sequence and alltoallv (the pooled one, with its placed form
and kept plans, is ``pooled_alltoall.py``).

Each is differentiable with an all-to-all of the gradients, with the send and receive sizes swapped,
as its backward. Sizes below: ``W`` ranks, this rank ``me``, ``B_r`` rank ``r``'s batch size,
``D_r`` the embedding columns rank ``r`` computes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_rank
from shardkit.distributed.codecs import QuantizedCommCodecs
from shardkit.distributed.comm_ops.exchange import (
    Layout,
    agree_values,
    all_to_all,
    backward_codec,
    check_local,
    check_sizes,
    checked_plan,
    forward_codec,
    join,
    world_of,
)
from shardkit.distributed.comm_ops.infos import (
    All2AllSequenceInfo,
    All2AllVInfo,
    VariableBatchAll2AllPooledInfo,
)
from shardkit.distributed.comm_ops.request import CommPlan, Request, start_request
from shardkit.distributed.tensor_split import split_sizes
from shardkit.distributed.validation import validation_enabled

ProcessGroup = dist.ProcessGroup


# --------------------------------------------------------------------------------------------------
# variable_batch_alltoall_pooled


class _FlatPlan(CommPlan):
    """A flat all-to-all: ``send[r]`` elements to rank ``r``, ``recv[s]`` from rank ``s``.

    Input of any shape (sent in row-major order) -> 1-D output of ``sum(recv)`` elements; the
    gradient is reshaped to the input's shape.
    """

    def __init__(
        self, info: VariableBatchAll2AllPooledInfo, layout: Layout, shape, world: int, group, dtype
    ) -> None:
        super().__init__(world, info)
        self._layout, self.shape, self.group, self.dtype = layout, shape, group, dtype
        self.codecs = info.codecs

    def layout(self) -> Layout:
        return self._layout

    def start_forward(self, inputs):
        chunks = inputs[0].reshape(-1).split(list(self._layout.send))
        received = all_to_all(chunks, self._layout.recv, self.dtype, forward_codec(self.codecs), self.group)
        return received.then(join)

    def start_backward(self, grads):
        chunks = grads[0].split(list(self._layout.recv))
        received = all_to_all(chunks, self._layout.send, self.dtype, backward_codec(self.codecs), self.group)
        return received.then(lambda pieces: (join(pieces).view(self.shape),))


def variable_batch_alltoall_pooled(
    a2a_pooled_embs_tensor: torch.Tensor,
    batch_size_per_rank_per_feature: list[list[int]],
    batch_size_per_feature_pre_a2a: list[int],
    emb_dim_per_rank_per_feature: list[list[int]],
    group: Optional[ProcessGroup] = None,
    codecs: Optional[QuantizedCommCodecs] = None,
) -> Request[torch.Tensor]:
    """All-to-all of pooled embeddings with per-feature, per-rank batch sizes -> ``Awaitable`` of 1-D.

    The input (any shape, read flat) holds, for each destination rank ``r`` in order, each local
    feature ``f``'s ``batch_size_per_rank_per_feature[r][f] * emb_dim_per_rank_per_feature[me][f]``
    values. The output holds, for each source rank ``s`` and each of its features (global feature
    ``g``), ``batch_size_per_feature_pre_a2a[g] * emb_dim_per_rank_per_feature[s][f]`` values.
    Backward: all-to-all with swapped sizes, gradient reshaped to the input's shape, divided by ``W``
    when gradient division is on. Saved for backward: the sizes (ints) and the input's shape.
    """
    world, rank = world_of(group), group_rank(group)
    x = a2a_pooled_embs_tensor
    info = VariableBatchAll2AllPooledInfo(
        batch_size_per_rank_per_feature=[list(b) for b in batch_size_per_rank_per_feature],
        batch_size_per_feature_pre_a2a=list(batch_size_per_feature_pre_a2a),
        emb_dim_per_rank_per_feature=[list(d) for d in emb_dim_per_rank_per_feature],
        codecs=codecs,
    )

    def build() -> _FlatPlan:
        batches, dims = info.batch_size_per_rank_per_feature, info.emb_dim_per_rank_per_feature
        pre = info.batch_size_per_feature_pre_a2a
        what = f"variable_batch_alltoall_pooled on rank {rank}"
        check_local(
            len(dims) == world, f"{what}: emb_dim_per_rank_per_feature has {len(dims)} ranks, not {world}"
        )
        check_local(
            len(batches) == world,
            f"{what}: batch_size_per_rank_per_feature has {len(batches)} ranks, not {world}",
        )
        local_features = len(dims[rank])
        check_local(
            all(len(b) == local_features for b in batches),
            f"{what}: batch_size_per_rank_per_feature {batches} must list {local_features} local "
            f"features per rank",
        )
        total_features = sum(len(d) for d in dims)
        check_local(
            len(pre) == total_features,
            f"{what}: batch_size_per_feature_pre_a2a has {len(pre)} entries for {total_features} features",
        )
        send = [sum(b * d for b, d in zip(batches[r], dims[rank])) for r in range(world)]
        bounds = [sum(len(d) for d in dims[:s]) for s in range(world + 1)]
        recv = [sum(b * d for b, d in zip(pre[bounds[s] : bounds[s + 1]], dims[s])) for s in range(world)]
        check_local(
            x.numel() == sum(send),
            f"{what}: input has {x.numel()} elements, the batch sizes and dims give {sum(send)}",
        )
        info.input_splits, info.output_splits = send, recv
        layout = Layout(tuple(send), tuple(recv), agree_values(x.dtype, codecs))
        return _FlatPlan(info, layout, x.shape, world, group, x.dtype)

    plan = checked_plan("variable_batch_alltoall_pooled", group, build, _FlatPlan.layout)
    return start_request(plan, group, (x,))


# --------------------------------------------------------------------------------------------------
# alltoall_sequence


def _permute_segments(
    values: torch.Tensor, lengths: torch.Tensor, order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder segments of ``values``' rows: segment ``i`` of the result is segment ``order[i]``.

    ``lengths`` is ``[S, k]`` (segment ``i`` has ``lengths[i].sum()`` rows). Returns the permuted
    values and the permuted ``lengths`` (``lengths[order]``).
    """
    rows = lengths.sum(dim=1)
    starts = torch.cumsum(rows, 0) - rows
    new_rows = rows[order]
    new_starts = torch.cumsum(new_rows, 0) - new_rows
    total = values.size(0)
    # row j of segment i in the result comes from row j of segment order[i]
    shift = torch.repeat_interleave(starts[order] - new_starts, new_rows, output_size=total)
    index = shift + torch.arange(total, device=shift.device)
    return values.index_select(0, index.to(values.device)), lengths[order]


def _check_permutation(order: torch.Tensor, size: int, name: str, rank: int) -> None:
    check_local(
        order.dim() == 1 and order.numel() == size,
        f"alltoall_sequence on rank {rank}: {name} has shape {tuple(order.shape)}, expected [{size}]",
    )
    if validation_enabled():  # a host sync: only with validation on
        check_local(
            torch.equal(order.sort().values.cpu().to(torch.int64), torch.arange(size)),
            f"alltoall_sequence on rank {rank}: {name} is not a permutation of 0..{size - 1}",
        )


class _SequencePlan(CommPlan):
    """Input ``[N, D]`` (rows in feature-major order) -> output ``[sum(input_splits), D]``."""

    def __init__(self, info: All2AllSequenceInfo, world: int, group, dtype, segments) -> None:
        super().__init__(world, info)
        self.group, self.dtype, self.segments = group, dtype, segments

    def layout(self) -> Layout:
        dim = self.info.embedding_dim
        send = tuple(n * dim for n in self.info.output_splits)
        recv = tuple(n * dim for n in self.info.input_splits)
        return Layout(send, recv, agree_values(self.dtype, self.info.codecs, ("embedding dim", dim)))

    def start_forward(self, inputs):
        x, info = inputs[0], self.info
        if info.forward_recat_tensor is not None:
            x, info.permuted_lengths_after_sparse_data_all2all = _permute_segments(
                x, self.segments, info.forward_recat_tensor
            )
        chunks = x.split(info.output_splits, dim=0)
        received = all_to_all(chunks, self.layout().recv, self.dtype, forward_codec(info.codecs), self.group)
        return received.then(lambda pieces: join(pieces).view(-1, info.embedding_dim))

    def start_backward(self, grads):
        info = self.info
        chunks = grads[0].split(info.input_splits, dim=0)
        received = all_to_all(chunks, self.layout().send, self.dtype, backward_codec(info.codecs), self.group)
        return received.then(self._unpermute)

    def _unpermute(self, pieces: list[torch.Tensor]) -> tuple[torch.Tensor]:
        info = self.info
        grad = join(pieces).view(-1, info.embedding_dim)
        if info.forward_recat_tensor is not None:
            grad, _ = _permute_segments(
                grad, info.permuted_lengths_after_sparse_data_all2all, info.backward_recat_tensor
            )
        return (grad,)


def alltoall_sequence(
    a2a_sequence_embs_tensor: torch.Tensor,
    forward_recat_tensor: Optional[torch.Tensor],
    backward_recat_tensor: Optional[torch.Tensor],
    lengths_after_sparse_data_all2all: torch.Tensor,
    input_splits: list[int],
    output_splits: list[int],
    variable_batch_size: bool = False,
    group: Optional[ProcessGroup] = None,
    codecs: Optional[QuantizedCommCodecs] = None,
) -> Request[torch.Tensor]:
    """Sequence embeddings back to their ids' ranks: ``[N, D]`` -> ``Awaitable[[sum(input_splits), D]]``.

    The answer to a sparse (ids) all-to-all: ``input_splits[r]`` ids went from this rank to rank
    ``r`` and ``output_splits[r]`` came from rank ``r``. The input ``[N, D]``, ``N = sum(output_splits)``,
    holds one row per id received, in the order given by ``lengths_after_sparse_data_all2all`` (any
    integer shape, read as ``[S, -1]`` with ``S = len(forward_recat_tensor)``: segment ``i`` is
    ``lengths[i].sum()`` rows; e.g. ``[T_local * W, B]`` feature-major). ``forward_recat_tensor``
    reorders the segments into source-rank order before sending (``permute_2D``-style; with
    ``variable_batch_size`` every length entry is one segment, ``permute_1D``-style);
    ``backward_recat_tensor`` must be its inverse and restores the order of the gradient. Without a
    forward recat the rows are sent in their order. ``D`` must be the same on every rank.
    Backward: all-to-all with swapped splits, then the backward recat, divided by ``W`` when gradient
    division is on. Saved for backward: splits (ints), recat tensors and the permuted lengths.
    """
    world, rank = world_of(group), group_rank(group)
    x = a2a_sequence_embs_tensor
    lengths = lengths_after_sparse_data_all2all
    info = All2AllSequenceInfo(
        embedding_dim=x.size(1) if x.dim() == 2 else -1,
        lengths_after_sparse_data_all2all=lengths,
        forward_recat_tensor=forward_recat_tensor,
        backward_recat_tensor=backward_recat_tensor,
        input_splits=list(input_splits),
        output_splits=list(output_splits),
        variable_batch_size=variable_batch_size,
        codecs=codecs,
    )

    def build() -> _SequencePlan:
        what = f"alltoall_sequence on rank {rank}"
        check_local(x.dim() == 2, f"{what}: input must be [N, D], got shape {tuple(x.shape)}")
        info.input_splits = check_sizes("input_splits", input_splits, world, rank)
        info.output_splits = check_sizes("output_splits", output_splits, world, rank)
        check_local(
            sum(info.output_splits) == x.size(0),
            f"{what}: output_splits {info.output_splits} sum to {sum(info.output_splits)}, "
            f"but the input has {x.size(0)} rows",
        )
        segments = None
        if forward_recat_tensor is not None:
            check_local(
                not variable_batch_size or forward_recat_tensor.numel() == lengths.numel(),
                f"{what}: with variable_batch_size the forward_recat_tensor permutes every length entry "
                f"({lengths.numel()}), got {forward_recat_tensor.numel()} entries",
            )
            segments = _recat_segments(
                forward_recat_tensor, backward_recat_tensor, lengths, x.size(0), what, rank
            )
        return _SequencePlan(info, world, group, x.dtype, segments)

    plan = checked_plan("alltoall_sequence", group, build, _SequencePlan.layout)
    return start_request(plan, group, (x,))


def _recat_segments(
    forward: torch.Tensor,
    backward: Optional[torch.Tensor],
    lengths: torch.Tensor,
    rows: int,
    what: str,
    rank: int,
) -> torch.Tensor:
    """``lengths`` as ``[S, -1]`` segments for the recat, after checking the recat tensors against it."""
    size = forward.numel()
    check_local(backward is not None, f"{what}: a forward_recat_tensor needs a backward_recat_tensor")
    check_local(
        size > 0 and lengths.numel() % size == 0,
        f"{what}: lengths_after_sparse_data_all2all has {lengths.numel()} entries, "
        f"not a multiple of the {size} segments of forward_recat_tensor",
    )
    _check_permutation(forward, size, "forward_recat_tensor", rank)
    _check_permutation(backward, size, "backward_recat_tensor", rank)
    if validation_enabled():
        check_local(
            torch.equal(forward[backward].cpu().to(torch.int64), torch.arange(size)),
            f"{what}: backward_recat_tensor is not the inverse of forward_recat_tensor",
        )
    segments = lengths.reshape(size, -1).to(torch.int64)
    total = int(segments.sum())  # a host sync the permutation needs anyway (its output size)
    check_local(
        total == rows, f"{what}: lengths_after_sparse_data_all2all sum to {total}, the input has {rows} rows"
    )
    return segments


# --------------------------------------------------------------------------------------------------
# alltoallv


class _VPlan(CommPlan):
    """Inputs ``[B_global, D_i]`` -> one output ``[B_local, dims_sum_per_rank[s]]`` per source rank ``s``."""

    def __init__(self, info: All2AllVInfo, world: int, group, dtype) -> None:
        super().__init__(world, info)
        self.group, self.dtype = group, dtype

    def layout(self) -> Layout:
        info = self.info
        return Layout(
            tuple(info.input_split_sizes),
            tuple(info.output_split_sizes),
            agree_values(self.dtype, info.codecs),
        )

    def start_forward(self, inputs):
        info = self.info
        # rows of every input for one rank together: [B_r, sum_i D_i] per destination
        chunks = torch.cat(inputs, dim=1).split(info.B_local_list, dim=0)
        received = all_to_all(
            chunks, info.output_split_sizes, self.dtype, forward_codec(info.codecs), self.group
        )
        return received.then(
            lambda pieces: tuple(p.view(info.B_local, d) for p, d in zip(pieces, info.dims_sum_per_rank))
        )

    def start_backward(self, grads):
        info = self.info
        received = all_to_all(
            grads, info.input_split_sizes, self.dtype, backward_codec(info.codecs), self.group
        )
        return received.then(self._split_columns)

    def _split_columns(self, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        info = self.info
        width = sum(info.D_local_list)
        grad = join(pieces).view(sum(info.B_local_list), width)
        return tuple(g.contiguous() for g in grad.split(info.D_local_list, dim=1))


def alltoallv(
    inputs: list[torch.Tensor],
    out_split: Optional[list[int]] = None,
    per_rank_split_lengths: Optional[list[int]] = None,
    group: Optional[ProcessGroup] = None,
    codecs: Optional[QuantizedCommCodecs] = None,
) -> Request[list[torch.Tensor]]:
    """All-to-all of ``[B_global, D_i]`` tensors -> ``Awaitable`` of ``[B_local, dims_sum_per_rank[s]]``s.

    ``B_global`` rows are split over ranks by the ``array_split`` rule (the first ``B_global % W``
    ranks get one more); rank ``r`` receives its rows of every input of every rank. ``out_split``
    gives the columns received from each rank (``dims_sum_per_rank``); otherwise
    ``per_rank_split_lengths[s] * D_0`` (every input has the same width). Backward: all-to-all with
    swapped sizes, split into one gradient per input, divided by ``W`` when gradient division is on.
    Saved for backward: the sizes (ints).
    """
    world, rank = world_of(group), group_rank(group)
    inputs = list(inputs)

    def build() -> _VPlan:
        what = f"alltoallv on rank {rank}"
        check_local(len(inputs) > 0, f"{what}: inputs is empty")
        check_local(
            all(t.dim() == 2 and t.size(0) == inputs[0].size(0) for t in inputs),
            f"{what}: inputs must be 2-D with equal numbers of rows, got {[tuple(t.shape) for t in inputs]}",
        )
        check_local(
            len({t.dtype for t in inputs}) == 1,
            f"{what}: inputs have different dtypes {[t.dtype for t in inputs]}",
        )
        d_local = [t.size(1) for t in inputs]
        if out_split is not None:
            dims = check_sizes("out_split", out_split, world, rank)
        elif per_rank_split_lengths is not None:
            dims = [
                n * d_local[0]
                for n in check_sizes("per_rank_split_lengths", per_rank_split_lengths, world, rank)
            ]
        else:
            raise ValueError(f"{what}: give out_split or per_rank_split_lengths")
        b_global = inputs[0].size(0)
        b_list = split_sizes(b_global, world)
        info = All2AllVInfo(
            dims_sum_per_rank=dims,
            B_global=b_global,
            B_local=b_list[rank],
            B_local_list=b_list,
            D_local_list=d_local,
            input_split_sizes=[b * sum(d_local) for b in b_list],
            output_split_sizes=[b_list[rank] * d for d in dims],
            codecs=codecs,
        )
        return _VPlan(info, world, group, inputs[0].dtype)

    plan = checked_plan("alltoallv", group, build, _VPlan.layout)
    return start_request(plan, group, tuple(inputs), as_list=True)
