"""Sequence layout for context parallelism and packed sequences, as RL trainers (NeMo RL, Megatron) use.

Context parallelism (CP) splits the sequence dimension over a group of ``cp`` ranks. For causal
attention the split is load-balanced: each sequence (of a length divisible by ``2 * cp``) is cut into
``2 * cp`` equal pieces and CP rank ``r`` holds pieces ``r`` and ``2 * cp - 1 - r``, in that order. A
packed batch (sequences concatenated along one token axis, delimited by ``cu_seqlens``) is split
sequence by sequence the same way (Transformer Engine's "THD" layout), so every rank holds its two
pieces of every sequence, in sequence order.

Everything here is index arithmetic on the host-known lengths (no communication) except
``gather_context_parallel``, which all-gathers per-rank values ``[..., S/cp]`` and puts them back in
sequence order; its backward keeps this rank's positions (a replicated result used identically on every
CP rank, like ``shardkit.distributed.regions.gather_from_region``), or first sums the gradient over the
CP ranks (``sum_grad=True``, NeMo RL's rule, for a loss each CP rank computes on its own part).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_rank, group_size
from shardkit.distributed.regions import gather_from_region, gather_from_region_sum_grad


def segment_bounds(cu_seqlens: Optional[torch.Tensor], total: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of each packed sequence, or ``[(0, total)]`` without ``cu_seqlens``.

    ``cu_seqlens`` ``[N + 1]`` int, non-decreasing from 0 to ``total`` (one host sync to read it).
    """
    if cu_seqlens is None:
        return [(0, total)]
    bounds = [int(v) for v in cu_seqlens.reshape(-1).tolist()]
    if (
        len(bounds) < 2
        or bounds[0] != 0
        or bounds[-1] != total
        or any(b < a for a, b in zip(bounds, bounds[1:]))
    ):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the packed length {total}, got {bounds[:8]}"
            f"{'...' if len(bounds) > 8 else ''}"
        )
    return list(zip(bounds[:-1], bounds[1:]))


def context_parallel_positions(
    bounds: Sequence[tuple[int, int]], cp_size: int, cp_rank: int, device: torch.device
) -> torch.Tensor:
    """Global positions ``[T / cp]`` int64 held by ``cp_rank``, in its local order (see the module doc).

    ``ValueError`` when a sequence length is not a multiple of ``2 * cp``.
    """
    if cp_size == 1:
        return torch.arange(bounds[-1][1] if bounds else 0, device=device)
    pieces = []
    for start, end in bounds:
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"context parallelism over {cp_size} ranks needs every sequence length to be a multiple "
                f"of {2 * cp_size}; the sequence at [{start}, {end}) has length {length} (pad it)"
            )
        piece = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + index * piece, start + (index + 1) * piece, device=device))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=device)


def gather_context_parallel(
    local: torch.Tensor,
    bounds: Sequence[tuple[int, int]],
    cp_group: Optional[dist.ProcessGroup],
    sum_grad: bool = False,
) -> torch.Tensor:
    """``[..., T/cp]`` on each CP rank (its positions, local order) -> ``[..., T]`` in sequence order.

    ``cp_group=None``: no context parallelism, ``local`` comes back.
    Differentiable: the backward keeps this rank's positions of the gradient (the result is replicated
    over the CP group and is meant to be used identically there); with ``sum_grad`` it first sums the
    gradient over the CP ranks (each rank's loss its own). One all-gather of ``local`` (and in backward
    with ``sum_grad``, one reduce-scatter).
    """
    # None means no context parallelism here (not the default group, as elsewhere)
    cp_size = 1 if cp_group is None else group_size(cp_group)
    if cp_size == 1:
        return local
    gather = gather_from_region_sum_grad if sum_grad else gather_from_region
    gathered = gather(local, -1, cp_group)  # [..., cp * T/cp], rank by rank
    order = torch.cat([context_parallel_positions(bounds, cp_size, r, local.device) for r in range(cp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return gathered.index_select(-1, inverse)


def cp_rank_and_size(cp_group: Optional[dist.ProcessGroup], used: bool) -> tuple[int, int]:
    """``(rank, size)`` in ``cp_group``; ``(0, 1)`` when context parallelism is not used."""
    if not used:
        return 0, 1
    return group_rank(cp_group), group_size(cp_group)


__all__ = [
    "context_parallel_positions",
    "cp_rank_and_size",
    "gather_context_parallel",
    "segment_bounds",
]
