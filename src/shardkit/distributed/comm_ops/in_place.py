"""The comm ops' exchanges written into and read out of the shared-memory exchange's buffers in place.

Why: through ``all_to_all_single`` an op packs its chunks into a send buffer, the shared-memory
exchange copies the peers' chunks into its file and this rank's own chunk into the receive buffer,
each rank copies its peers' chunks out into its receive buffer, and the op then copies them from
there into its result. Here (``SharedMemoryExchange.exchange_parts``) each chunk for a peer is
written straight from the op's tensor into the exchange's file, this rank's own chunk goes straight
to its place in the result, and the peers' chunks are read straight out of their files into the
result: the table-wise pooled all-to-all of a ``[256, 8192]`` fp32 output per rank (2 ranks) copies
3 chunks of 4 MiB each way where it copied 5, and its backward divides by the world size in those
copies instead of in a pass of its own.

Each function returns None where the group's byte exchanges do not go through shared memory
(switched off, several hosts, not gloo): the caller then takes its usual path. The results are
bitwise the usual path's: copies, and the two-rank reduce-scatter's single addition in rank order.
Sizes below: ``W`` ranks, this rank ``me``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from shardkit.distributed.comm_ops import scratch
from shardkit.distributed.comm_ops.pending import Pending
from shardkit.distributed.comm_ops.placement import ColumnPlacement
from shardkit.distributed.direct_collectives import shm_exchange_for


def _offsets(sizes: Sequence[int]) -> List[int]:
    at = [0]
    for n in sizes:
        at.append(at[-1] + n)
    return at


def pooled_placed_forward(
    x: torch.Tensor, batch: Sequence[int], placement: ColumnPlacement, rank: int, group
) -> Optional[Pending[torch.Tensor]]:
    """``x`` ``[sum_r B_r, D_me]`` (contiguous) -> ``[B_me, blocks * width]``, rank ``r``'s
    ``[B_me, D_r]`` rows placed by ``placement`` (a ``comm_ops.scratch`` buffer)."""
    exchange = shm_exchange_for(group, x)
    if exchange is None:
        return None
    world, item, d_me = len(batch), x.element_size(), x.size(1)
    row_at = _offsets(batch)
    dims = [placement.columns(r) for r in range(world)]
    out = scratch.new_empty(x, batch[rank], placement.blocks * placement.width)

    def pack(r: int, buf: torch.Tensor) -> None:
        buf.view(x.dtype).view(batch[r], d_me).copy_(x[row_at[r] : row_at[r + 1]])

    def unpack(s: int, view: torch.Tensor) -> None:
        placement.place(out, s, view.view(x.dtype))

    work = exchange.exchange_parts(
        [b * d_me * item for b in batch], [batch[rank] * d * item for d in dims], pack, unpack
    )
    placement.place(out, rank, x[row_at[rank] : row_at[rank + 1]])  # after publishing: peers read meanwhile
    return Pending(work, lambda: out)


def pooled_placed_backward(
    grad: torch.Tensor, batch: Sequence[int], placement: ColumnPlacement, rank: int, group, divisor: int
) -> Optional[Pending[tuple]]:
    """The gradient ``[B_me, blocks * width]`` -> ``([sum_r B_r, D_me],)``: rank ``r``'s placed columns
    of its samples back to this rank's rows of them (a ``comm_ops.scratch`` buffer), divided by
    ``divisor`` in the copies when it is > 1 (gradient division: the result is ``divided``)."""
    exchange = shm_exchange_for(group, grad)
    if exchange is None:
        return None
    grad = grad.contiguous()
    world, item, b_me = len(batch), grad.element_size(), grad.size(0)
    d_me = placement.columns(rank)
    row_at = _offsets(batch)
    out = scratch.new_empty(grad, row_at[-1], d_me)

    def pack(r: int, buf: torch.Tensor) -> None:
        placement.take(grad, r, buf.view(grad.dtype))

    def unpack(s: int, view: torch.Tensor) -> None:
        rows = out[row_at[s] : row_at[s + 1]].view(-1)
        if divisor > 1:
            torch.div(view.view(grad.dtype), divisor, out=rows)
        else:
            rows.copy_(view.view(grad.dtype))

    work = exchange.exchange_parts(
        [b_me * placement.columns(r) * item for r in range(world)],
        [b * d_me * item for b in batch],
        pack,
        unpack,
    )
    placement.take(grad, rank, out[row_at[rank] : row_at[rank + 1]], divisor)
    return Pending(work, lambda: (out,), divided=divisor > 1)


def reduce_scatter_pair(
    chunks: Sequence[torch.Tensor], dtype: torch.dtype, rank: int, group
) -> Optional[Pending[torch.Tensor]]:
    """Two ranks: this rank's flat sum ``chunks_0[me] + chunks_1[me]`` (rank 0's term first), its peer's
    term read straight out of the peer's file. ``chunks``: ``dtype`` (one that sums in itself:
    float32, float64, int64), contiguous; the sum is a ``comm_ops.scratch`` buffer from
    ``scratch.MIN_BYTES`` on (as ``exchange._sum_pieces``)."""
    exchange = shm_exchange_for(group, chunks[rank])
    if exchange is None:
        return None
    own = chunks[rank].reshape(-1)
    item, numel = own.element_size(), own.numel()
    big = numel * item >= scratch.MIN_BYTES
    result = [scratch.new_empty(own, numel) if big else None]

    def pack(r: int, buf: torch.Tensor) -> None:
        buf.view(dtype).copy_(chunks[r].reshape(-1))

    def unpack(s: int, view: torch.Tensor) -> None:
        terms = (own, view.view(dtype)) if rank == 0 else (view.view(dtype), own)
        result[0] = torch.add(*terms, out=result[0]) if big else torch.add(*terms)

    work = exchange.exchange_parts(
        [chunk.numel() * item for chunk in chunks], [numel * item] * 2, pack, unpack
    )
    if not numel:
        return Pending(work, lambda: own.new_empty(0))
    return Pending(work, lambda: result[0])


def all_gather_shared(
    chunk: torch.Tensor, numels: Sequence[int], dtype: torch.dtype, rank: int, group, divisor: int = 1
) -> Optional[Pending[List[torch.Tensor]]]:
    """Every rank's flat chunk (rank ``r``'s ``numels[r]`` elements of ``dtype``) -> one flat tensor per
    rank, back to back in one ``comm_ops.scratch`` buffer; this rank's chunk written once into its file
    for every peer to read. ``divisor`` > 1: the result divided by it in the copies (``divided``)."""
    exchange = shm_exchange_for(group, chunk)
    if exchange is None:
        return None
    flat = chunk.reshape(-1)
    item = flat.element_size()
    at = _offsets(numels)
    out = scratch.new_empty(flat, at[-1])

    def place(src: torch.Tensor, dst: torch.Tensor) -> None:
        if divisor > 1:
            torch.div(src, divisor, out=dst)
        else:
            dst.copy_(src)

    def pack(r: int, buf: torch.Tensor) -> None:
        buf.view(dtype).copy_(flat)

    def unpack(s: int, view: torch.Tensor) -> None:
        place(view.view(dtype), out[at[s] : at[s + 1]])

    world = len(numels)
    work = exchange.exchange_parts(
        [numels[rank] * item] * world, [n * item for n in numels], pack, unpack, shared=True
    )
    place(flat, out[at[rank] : at[rank + 1]])
    return Pending(work, lambda: list(out.split_with_sizes(list(numels))), divided=divisor > 1)


__all__ = ["all_gather_shared", "pooled_placed_backward", "pooled_placed_forward", "reduce_scatter_pair"]
