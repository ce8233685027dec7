"""Tensor-parallel region mappings: differentiable copy / reduce / scatter / gather over a process group.

A model-parallel region is a stretch of the model where each rank of ``group`` holds a different part
of the work. Its boundaries are these mappings, each a ``torch.autograd.Function`` whose backward is
its dual mapping (called through ``.apply``, so that double backward works):

- ``copy_to_region``: forward identity; backward all-reduce (``reduce_from_region``).
- ``reduce_from_region``: forward all-reduce on a copy; backward identity (``copy_to_region``).
- ``scatter_to_region``: forward keep own chunk along ``dim``; backward gather (``gather_from_region``).
- ``gather_from_region``: forward all-gather + concat along ``dim``; backward keep own chunk
  (``scatter_to_region``).
- ``gather_from_region_sum_grad``: forward as ``gather_from_region``; backward sum over ranks, then
  keep own chunk (``reduce_scatter_to_region``).
- ``reduce_scatter_to_region``: forward sum over ranks, then keep own chunk; backward gather
  (``gather_from_region_sum_grad``).
- ``gather_from_region_local_grad``: forward as ``gather_from_region``; backward keep own chunk by a
  local slice, whose own backward is local zero padding (the per-rank contract below).

Gradient convention (Megatron's): a tensor that every rank holds identically (the output of a gather
or an all-reduce) is used identically on every rank, so its gradient is the same on every rank and
is not summed. When ranks instead use a replicated tensor for different work (their own edges of a
graph), its per-rank gradients are partial sums: enter the region with ``copy_to_region`` (or gather
with ``gather_from_region_sum_grad``), whose backward sums them. Using ``gather_from_region`` there
silently drops the other ranks' contributions.

The dual pairs are copy <-> reduce, scatter <-> gather and reduce-scatter <-> sum-grad gather. The
last pairing matters for double backward only: the gradient of a reduce-scatter's input is gathered
(the same values as a plain gather), and the work each rank did to produce that input differs, so
what flows back into that gather is a per-rank partial sum.

Double backward. A backward is itself a computation, so its backward (the second order) depends on
what the replicated tensors mean. Here a replicated tensor (the output of a gather or an all-reduce,
and also a replicated gradient: the output of the backward of a copy or a scatter) is one logical
tensor used identically on every rank, so the second-order reference is one single-process graph on
the global tensors, with each rank's second-order terms summed. Every mapping above is exact against
it at first and second order (tests/distributed/test_regions.py checks each with Hessians that couple
the chunks). ``gather_from_region_local_grad`` has the per-rank contract of fairchem's gp_utils
instead: each rank's gathered tensor is its own and the other ranks' chunks are constants to it, so
each rank's gradients, of every order, come from its own loss only. The two contracts agree at first
order and differ at second order only where a rank's loss couples its own chunk with another's.

Chunks follow numpy's ``array_split`` rule (``shardkit.distributed.tensor_split.split_sizes``) unless
explicit per-rank ``sizes`` are given; a rank's chunk may be empty. Gathers handle uneven sizes by
padding every chunk with zeros to the largest size, all-gathering, and trimming.

``group=None`` means the default group. With a group of one rank, or without an initialized
``torch.distributed``, every mapping is the identity and nothing is communicated.

Validation happens before the first collective, and a mismatch raises the same ``ValueError`` on every
rank: a gather always exchanges all ranks' shapes (it needs the split-dim sizes anyway) and checks
``ndim`` and the non-split dimensions; the all-reduce based mappings check that shapes agree when
``shardkit.distributed.validation.validation_enabled()`` (one small extra all-gather). The same
exchange compares dtypes and, for gathers, the ``dim``.

Dtypes are kept. gloo sums float16 / bfloat16 pairwise in that precision (older torch releases reject
bfloat16 there) and rejects int16, so on gloo these are summed in float32 / int64 and cast back once.
A gather only moves bytes, so on gloo it sends every dtype as bytes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import (
    all_gather_flat,
    format_per_rank,
    gather_shapes,
    group_rank,
    group_size,
    reduce_scatter_flat,
)
from shardkit.distributed.tensor_split import normalize_dim, pad_tensor, split_offsets, split_sizes
from shardkit.distributed.validation import validation_enabled

ProcessGroup = dist.ProcessGroup
Sizes = tuple[int, ...]

# gloo sums these in their own precision (fp16 / bf16: rounding at every pairwise step) or not at all
# (int16, and bfloat16 in older torch releases), so on gloo they are summed in a wider type and cast
# back once
_GLOO_SUM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.int16: torch.int64}


# --------------------------------------------------------------------------------------------------
# local helpers (no autograd)


def _world(group: Optional[ProcessGroup]) -> int:
    size = group_size(group)
    if size < 1:
        # torch answers -1 for a group this process is not in; any collective on it would misbehave
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the given process group")
    return size


def _is_gloo(tensor: torch.Tensor, group: Optional[ProcessGroup]) -> bool:
    backend = str(dist.get_backend(group))
    # a group may carry one backend per device type, e.g. "cpu:gloo,cuda:nccl"
    return backend == "gloo" or (f"{tensor.device.type}:gloo" in backend)


def _check_same_shape(tensor: torch.Tensor, group: Optional[ProcessGroup], what: str) -> None:
    shapes = gather_shapes(tensor, group)
    if any(shape != shapes[0] for shape in shapes[1:]):
        raise ValueError(
            f"{what}: ranks of the group passed tensors of different shapes, which cannot be summed: "
            f"{format_per_rank(shapes)}"
        )


def _resolve_sizes(
    total: int, world: int, sizes: Optional[Sequence[int]], dim: int, rank: int, what: str
) -> Sizes:
    """Per-rank chunk sizes along ``dim``: the array_split rule, or ``sizes`` after checking them."""
    if sizes is None:
        return tuple(split_sizes(total, world))
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != world:
        raise ValueError(
            f"{what} on rank {rank}: got {len(sizes)} sizes {sizes} for a group of {world} ranks"
        )
    if any(s < 0 for s in sizes):
        raise ValueError(f"{what} on rank {rank}: sizes {sizes} contain a negative size")
    if sum(sizes) != total:
        raise ValueError(
            f"{what} on rank {rank}: sizes {sizes} sum to {sum(sizes)}, but dim {dim} has size {total}"
        )
    return sizes


def _own_chunk(tensor: torch.Tensor, dim: int, sizes: Sizes, rank: int) -> torch.Tensor:
    return tensor.narrow(dim, split_offsets(sizes)[rank], sizes[rank])


def _all_reduce_copy(tensor: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` into a new contiguous tensor of the same dtype (input untouched)."""
    wide = _GLOO_SUM_DTYPE.get(tensor.dtype)
    if wide is not None and _is_gloo(tensor, group):
        buffer = tensor.to(wide, memory_format=torch.contiguous_format)  # a copy: the dtype changes
        dist.all_reduce(buffer, group=group)
        return buffer.to(tensor.dtype)
    buffer = tensor.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(buffer, group=group)
    return buffer


def _reduce_scatter_chunk(
    tensor: torch.Tensor, dim: int, sizes: Sizes, group: Optional[ProcessGroup]
) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` and return this rank's chunk along ``dim`` (a new tensor).

    One reduce-scatter: the chunks are moved to dim 0 and padded with zeros to the largest size, so
    each rank receives 1/world of the data instead of all of it (as an all-reduce would).
    """
    rank = group_rank(group)
    max_size = max(sizes)
    if max_size == 0:
        return tensor.narrow(dim, 0, 0).clone()
    wide = _GLOO_SUM_DTYPE.get(tensor.dtype) if _is_gloo(tensor, group) else None
    chunks = torch.split(tensor.movedim(dim, 0), list(sizes))
    send = torch.cat([pad_tensor(chunk, 0, target_size=max_size) for chunk in chunks])
    send = send.to(wide or tensor.dtype)  # torch.cat already made a contiguous copy
    out = send.new_empty((max_size, *send.shape[1:]))
    reduce_scatter_flat(out, send, group=group)
    chunk = out[: sizes[rank]].to(tensor.dtype).movedim(0, dim)
    return chunk.contiguous().reshape(-1).view(chunk.shape)  # standard strides, as _all_gather_cat


def _exchange_split_sizes(
    tensor: torch.Tensor, dim: int, group: Optional[ProcessGroup], what: str
) -> tuple[int, Sizes]:
    """All ranks' sizes along ``dim``, after checking that all other dimensions agree.

    Every rank sees every rank's shape, so every rank reaches the same verdict and raises the same
    error; none is left waiting in the all-gather that follows.
    """
    # dim is normalized before the exchange, so that -1 and ndim - 1 agree
    dim = normalize_dim(tensor, dim)
    shapes = gather_shapes(tensor, group, dim=dim)
    if any(len(shape) != len(shapes[0]) for shape in shapes[1:]):
        raise ValueError(
            f"{what}: ranks of the group passed tensors with different numbers of dimensions: "
            f"{format_per_rank(shapes)}"
        )
    others = [shape[:dim] + shape[dim + 1 :] for shape in shapes]
    if any(other != others[0] for other in others[1:]):
        raise ValueError(
            f"{what}: ranks of the group passed tensors that differ outside the gathered dim {dim}: "
            f"{format_per_rank(shapes)}"
        )
    return dim, tuple(shape[dim] for shape in shapes)


def _trusted_split_sizes(
    tensor: torch.Tensor, dim: int, group: Optional[ProcessGroup], world: int, sizes: Sizes, what: str
) -> tuple[int, Sizes]:
    dim = normalize_dim(tensor, dim)
    rank = group_rank(group)
    if len(sizes) != world or sizes[rank] != tensor.size(dim):
        raise ValueError(
            f"{what} on rank {rank}: sizes {tuple(sizes)} do not match a group of {world} ranks "
            f"and this rank's size {tensor.size(dim)} along dim {dim}"
        )
    return dim, tuple(sizes)


def _with_standard_strides(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its strides are the row-major ones of its shape, else a row-major copy."""
    expected, step = [], 1
    for size in reversed(tensor.shape):
        expected.append(step)
        step *= max(size, 1)
    if tensor.stride() == tuple(reversed(expected)):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _all_gather_cat(
    tensor: torch.Tensor, dim: int, sizes: Sizes, group: Optional[ProcessGroup]
) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim``; chunk ``r`` has ``sizes[r]`` entries there."""
    max_size = max(sizes)
    if max_size == 0:
        return tensor.clone()  # every chunk is empty: the result is empty along dim too
    # zeros, not uninitialized memory, so that the padding is deterministic
    padded = pad_tensor(tensor, dim, target_size=max_size)
    # standard strides: a tensor that is "contiguous" may still carry odd strides on size-1 dims (a
    # gradient expanded from a scalar has stride 0 there), which view(uint8) below rejects
    padded = _with_standard_strides(padded)
    send = padded
    if _is_gloo(tensor, group) and padded.dtype != torch.uint8:
        # a gather only moves bytes, and gloo rejects some dtypes (int16, older: bfloat16): send bytes
        # (the last dim grows by the element size; viewing back undoes it)
        send = padded.view(torch.uint8)
    world = len(sizes)
    if dim == 0:
        # one flat buffer, and no concatenation at all when the chunks are even
        out = send.new_empty((world * send.size(0), *send.shape[1:]))
        all_gather_flat(out, send, group=group)
        out = out.view(tensor.dtype)
        if all(size == max_size for size in sizes):
            return out
        pieces = [out.narrow(0, r * max_size, sizes[r]) for r in range(world)]
    else:
        buffers = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(buffers, send, group=group)
        pieces = [buf.view(tensor.dtype).narrow(dim, 0, size) for buf, size in zip(buffers, sizes)]
    return torch.cat(pieces, dim=dim)


def _gather_forward(
    ctx,
    input: torch.Tensor,
    dim: int,
    group: Optional[ProcessGroup],
    sizes: Optional[Sequence[int]],
    what: str,
) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        dim = normalize_dim(input, dim)
        ctx.dim, ctx.group, ctx.sizes = dim, group, (input.size(dim),)
        return input
    if sizes is not None and not validation_enabled():
        dim, sizes = _trusted_split_sizes(input, dim, group, world, tuple(sizes), what)
    else:
        dim, sizes = _exchange_split_sizes(input, dim, group, what)
    ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
    return _all_gather_cat(input, dim, sizes, group)


# --------------------------------------------------------------------------------------------------
# autograd Functions


class CopyToRegion(torch.autograd.Function):
    """Enter a region: forward identity, backward all-reduce (sum) of the gradient over ``group``.

    ``apply(input, group=None)``: ``[*]`` -> ``[*]``, any dtype. Use it where every rank holds the same
    tensor and uses it for different work, so each rank's gradient is a partial sum.
    Saved for backward: ``group``.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
        _world(group)  # a group this rank is not in fails here, not later in the backward
        ctx.group = group
        return input  # autograd hands the caller a new tensor object (a view), not the input itself

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return ReduceFromRegion.apply(grad_output, ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """Leave a region: forward all-reduce (sum) over ``group`` on a copy, backward identity.

    ``apply(input, group=None)``: ``[*]`` (same shape on every rank) -> ``[*]``, same dtype; the
    caller's tensor is never modified. Checks that shapes agree across ranks when validation is on.
    Saved for backward: ``group``.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
        ctx.group = group
        if _world(group) == 1:
            return input
        if validation_enabled():
            _check_same_shape(input, group, "reduce_from_region")
        return _all_reduce_copy(input, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return CopyToRegion.apply(grad_output, ctx.group), None


class ScatterToRegion(torch.autograd.Function):
    """Enter a region: forward keep this rank's chunk along ``dim``, backward gather the gradient.

    ``apply(input, dim=-1, group=None, sizes=None)``: ``[..., n, ...]`` (the same on every rank) ->
    ``[..., sizes[rank], ...]``, same dtype, contiguous. ``sizes`` (one per rank, summing to ``n``)
    defaults to the array_split rule. No communication in forward.
    Saved for backward: ``dim``, ``group`` and all ranks' ``sizes`` (ints, no tensors).
    """

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        dim: int = -1,
        group: Optional[ProcessGroup] = None,
        sizes: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        world = _world(group)
        rank = group_rank(group)
        dim = normalize_dim(input, dim)
        sizes = _resolve_sizes(input.size(dim), world, sizes, dim, rank, "scatter_to_region")
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        if world == 1:
            return input
        return _own_chunk(input, dim, sizes, rank).contiguous()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return GatherFromRegion.apply(grad_output, ctx.dim, ctx.group, ctx.sizes), None, None, None


class GatherFromRegion(torch.autograd.Function):
    """Leave a region: forward all-gather + concat along ``dim``, backward keep own chunk of the gradient.

    ``apply(input, dim=-1, group=None, sizes=None)``: ``[..., n_r, ...]`` on rank ``r`` ->
    ``[..., sum_r n_r, ...]`` on every rank, same dtype. The ``n_r`` may differ (and be 0); all other
    dimensions must agree, which is checked on every rank. ``sizes`` (all ranks' ``n_r``, as saved by
    a dual mapping's forward) lets the shape exchange be skipped when validation is off.
    The gradient must be the same on every rank (see the module doc); otherwise use
    ``GatherFromRegionSumGrad``. Saved for backward: ``dim``, ``group``, all ranks' ``n_r`` (ints).
    """

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        dim: int = -1,
        group: Optional[ProcessGroup] = None,
        sizes: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        return _gather_forward(ctx, input, dim, group, sizes, "gather_from_region")

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return ScatterToRegion.apply(grad_output, ctx.dim, ctx.group, ctx.sizes), None, None, None


class GatherFromRegionLocalGrad(torch.autograd.Function):
    """Forward as ``GatherFromRegion``; backward keeps own chunk with a plain, rank-local slice.

    ``apply(input, dim=-1, group=None, sizes=None)``: shapes as in ``GatherFromRegion``. The contract is
    per rank, not logical: each rank's gathered tensor is its own (the other ranks' chunks are constants
    to it), so rank ``r``'s gradient comes only from rank ``r``'s own loss, at every order. The backward
    is therefore a local slice whose own backward (the double backward) is zero padding, with no
    communication; this is the gather of fairchem's gp_utils (and of Megatron, whose backward is a
    plain split). ``GatherFromRegion`` instead treats the gathered tensor as one logical tensor used
    identically everywhere, so its double backward gathers. Both agree at first order.
    Saved for backward: ``dim``, ``group``, all ranks' ``n_r`` (ints).
    """

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        dim: int = -1,
        group: Optional[ProcessGroup] = None,
        sizes: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        return _gather_forward(ctx, input, dim, group, sizes, "gather_from_region_local_grad")

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if len(ctx.sizes) == 1:
            return grad_output, None, None, None
        # narrow + contiguous are recorded by autograd under create_graph: their adjoint is the local
        # zero padding, which is exactly the double backward this contract needs
        own = _own_chunk(grad_output, ctx.dim, ctx.sizes, group_rank(ctx.group)).contiguous()
        return own, None, None, None


class GatherFromRegionSumGrad(torch.autograd.Function):
    """Like ``GatherFromRegion``, but the backward sums the gradient over ranks before keeping own chunk.

    ``apply(input, dim=-1, group=None, sizes=None)``: shapes as in ``GatherFromRegion``. Needed when
    ranks use the gathered tensor for different work (each rank its own edges), so each rank's gradient
    is a partial sum. Saved for backward: ``dim``, ``group``, all ranks' ``n_r`` (ints).
    """

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        dim: int = -1,
        group: Optional[ProcessGroup] = None,
        sizes: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        return _gather_forward(ctx, input, dim, group, sizes, "gather_from_region_sum_grad")

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = ReduceScatterToRegion.apply(grad_output, ctx.dim, ctx.group, ctx.sizes)
        return grad, None, None, None


class ReduceScatterToRegion(torch.autograd.Function):
    """Sum over ranks, then keep this rank's chunk along ``dim``; backward gathers the gradient.

    The backward is ``GatherFromRegionSumGrad`` (forward: a plain gather) because the summed input
    comes from different work on every rank, so a gradient flowing back into that gather in a double
    backward is a per-rank partial sum.

    ``apply(input, dim=-1, group=None, sizes=None)``: ``[..., n, ...]`` (same shape on every rank) ->
    ``[..., sizes[rank], ...]``, same dtype. ``sizes`` defaults to the array_split rule. Implemented as
    one reduce-scatter of chunks padded to the largest size. Checks that shapes agree across ranks when
    validation is on.
    Saved for backward: ``dim``, ``group``, all ranks' ``sizes`` (ints).
    """

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        dim: int = -1,
        group: Optional[ProcessGroup] = None,
        sizes: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        world = _world(group)
        rank = group_rank(group)
        dim = normalize_dim(input, dim)
        sizes = _resolve_sizes(input.size(dim), world, sizes, dim, rank, "reduce_scatter_to_region")
        ctx.dim, ctx.group, ctx.sizes = dim, group, sizes
        if world == 1:
            return input
        if validation_enabled():
            _check_same_shape(input, group, "reduce_scatter_to_region")
        return _reduce_scatter_chunk(input, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = GatherFromRegionSumGrad.apply(grad_output, ctx.dim, ctx.group, ctx.sizes)
        return grad, None, None, None


# --------------------------------------------------------------------------------------------------
# functional wrappers


def copy_to_region(input: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Forward identity, backward all-reduce of the gradient over ``group`` (see ``CopyToRegion``)."""
    return CopyToRegion.apply(input, group)


def reduce_from_region(input: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Forward all-reduce (sum, on a copy) over ``group``, backward identity (see ``ReduceFromRegion``)."""
    return ReduceFromRegion.apply(input, group)


def scatter_to_region(
    input: torch.Tensor,
    dim: int = -1,
    group: Optional[ProcessGroup] = None,
    sizes: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Keep this rank's chunk along ``dim``, backward gather (see ``ScatterToRegion``)."""
    return ScatterToRegion.apply(input, dim, group, sizes)


def gather_from_region(
    input: torch.Tensor, dim: int = -1, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """All-gather + concat along ``dim`` (uneven sizes allowed), backward own chunk.

    See ``GatherFromRegion``: the gathered tensor's gradient must be the same on every rank.
    """
    return GatherFromRegion.apply(input, dim, group)


def gather_from_region_local_grad(
    input: torch.Tensor, dim: int = -1, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """All-gather + concat along ``dim``, backward own chunk by a local slice at every order.

    See ``GatherFromRegionLocalGrad``: each rank's gradient comes only from its own loss, also in a
    double backward (whose adjoint is zero padding, not a gather).
    """
    return GatherFromRegionLocalGrad.apply(input, dim, group)


def gather_from_region_sum_grad(
    input: torch.Tensor, dim: int = -1, group: Optional[ProcessGroup] = None
) -> torch.Tensor:
    """All-gather + concat along ``dim``, backward sum over ranks then own chunk.

    See ``GatherFromRegionSumGrad``: use it when ranks do different work with the gathered tensor.
    """
    return GatherFromRegionSumGrad.apply(input, dim, group)


def reduce_scatter_to_region(
    input: torch.Tensor,
    dim: int = -1,
    group: Optional[ProcessGroup] = None,
    sizes: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Sum over ranks then own chunk along ``dim``, backward gather (see ``ReduceScatterToRegion``)."""
    return ReduceScatterToRegion.apply(input, dim, group, sizes)


__all__ = [
    "CopyToRegion",
    "GatherFromRegion",
    "GatherFromRegionLocalGrad",
    "GatherFromRegionSumGrad",
    "ReduceFromRegion",
    "ReduceScatterToRegion",
    "ScatterToRegion",
    "copy_to_region",
    "gather_from_region",
    "gather_from_region_local_grad",
    "gather_from_region_sum_grad",
    "reduce_from_region",
    "reduce_scatter_to_region",
    "scatter_to_region",
]
