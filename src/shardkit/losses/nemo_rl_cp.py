"""NeMo RL's context-parallel and all-reduce helpers (``nemo_rl.distributed.model_utils``), by name.

Thin faces over ``shardkit.losses.context_parallel`` (the load-balanced split: CP rank ``r`` of ``cp``
holds pieces ``r`` and ``2 * cp - 1 - r`` of ``2 * cp``) and ``shardkit.distributed.regions``:

- ``_get_tokens_on_this_cp_rank(input_ids, cp_rank, cp_size, seq_dim=1)``: this rank's two pieces
  along ``seq_dim`` (the length must be a multiple of ``2 * cp_size``; ``ValueError`` otherwise).
- ``allgather_cp_sharded_tensor(tensor, cp_group, seq_dim=1)`` / ``AllGatherCPTensor.apply(...)``:
  the inverse, an all-gather over ``cp_group`` back to sequence order; backward sums the gradient over
  the CP ranks and keeps this rank's pieces (NeMo RL's rule).
- ``cp_load_balanced_to_contiguous(x, *, cp_group=None, seq_dim=1)``: load-balanced pieces -> this
  rank's contiguous window ``[r * L, (r + 1) * L)`` (gathered, then narrowed; differentiable).
- ``cp_shift_next(x, cp_group=None, *, fill)``: ``out[:, t] = x[:, t + 1]`` over the global sequence
  split contiguously over ``cp_group`` (each rank's last row is the next rank's first; the global last
  is ``fill``). The row received from the next rank carries no gradient back to it (NeMo RL's rule).
- ``group_all_reduce_sum_with_grad(x, group)`` (backward identity) and ``group_all_reduce_sum(x,
  group)`` (no gradient): sum over ``group``; None, one rank or no process group: ``x`` itself.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_rank, group_size
from shardkit.distributed.regions import reduce_from_region
from shardkit.losses.context_parallel import context_parallel_positions, gather_context_parallel
from shardkit.losses.dtensor import is_dtensor


def _communicates(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and group_size(group) > 1


def _get_tokens_on_this_cp_rank(
    input_ids: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1
) -> torch.Tensor:
    """``[..., L, ...]`` -> ``[..., L / cp_size, ...]``: CP rank ``cp_rank``'s pieces along ``seq_dim``."""
    if cp_size == 1:
        return input_ids
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"_get_tokens_on_this_cp_rank: cp_rank {cp_rank} is not in [0, {cp_size})")
    length = input_ids.shape[seq_dim]
    positions = context_parallel_positions([(0, length)], cp_size, cp_rank, input_ids.device)
    return input_ids.index_select(seq_dim, positions)


def allgather_cp_sharded_tensor(
    tensor: torch.Tensor, cp_group: Optional[dist.ProcessGroup], seq_dim: int = 1
) -> torch.Tensor:
    """This rank's load-balanced pieces ``[..., L/cp, ...]`` -> the whole sequence ``[..., L, ...]``.

    Backward: the gradient summed over the CP ranks, this rank's pieces kept (NeMo RL's rule, for a
    loss each CP rank computes on its own part). One all-gather (and one reduce-scatter in backward).
    """
    if not _communicates(cp_group):
        return tensor
    seq_dim = seq_dim % tensor.dim()
    moved = tensor.movedim(seq_dim, -1)
    total = moved.shape[-1] * group_size(cp_group)
    gathered = gather_context_parallel(moved, [(0, total)], cp_group, sum_grad=True)
    return gathered.movedim(-1, seq_dim)


class AllGatherCPTensor:
    """NeMo RL's ``AllGatherCPTensor.apply(tensor, cp_group, seq_dim=1)``: ``allgather_cp_sharded_tensor``.

    Not a ``torch.autograd.Function`` subclass: ``apply`` runs the differentiable gather above.
    """

    @staticmethod
    def apply(tensor: torch.Tensor, cp_group: Optional[dist.ProcessGroup], seq_dim: int = 1) -> torch.Tensor:
        return allgather_cp_sharded_tensor(tensor, cp_group, seq_dim)


def cp_load_balanced_to_contiguous(
    x: torch.Tensor, *, cp_group: Optional[dist.ProcessGroup] = None, seq_dim: int = 1
) -> torch.Tensor:
    """Load-balanced pieces -> this CP rank's contiguous window (same shape); no-op without CP."""
    if not _communicates(cp_group):
        return x
    local = x.to_local() if is_dtensor(x) else x
    full = allgather_cp_sharded_tensor(local, cp_group, seq_dim=seq_dim)
    length = local.shape[seq_dim]
    return full.narrow(seq_dim, group_rank(cp_group) * length, length).contiguous()


def cp_shift_next(
    x: torch.Tensor, cp_group: Optional[dist.ProcessGroup] = None, *, fill: float
) -> torch.Tensor:
    """``[B, L, ...]`` -> ``[B, L, ...]`` shifted left by one along dim 1 over the global sequence."""
    tail = torch.full_like(x[:, :1], fill)
    if _communicates(cp_group):
        size, rank = group_size(cp_group), group_rank(cp_group)
        first = x[:, :1].detach().contiguous()
        rows = [torch.empty_like(first) for _ in range(size)]
        dist.all_gather(rows, first, group=cp_group)
        if rank < size - 1:
            tail = rows[rank + 1]
    return torch.cat([x[:, 1:], tail], dim=1)


def group_all_reduce_sum_with_grad(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (a new tensor); backward passes the gradient through unchanged."""
    return reduce_from_region(x, group) if _communicates(group) else x


def group_all_reduce_sum(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``group_all_reduce_sum_with_grad`` without a gradient (a constant, e.g. a token count)."""
    with torch.no_grad():
        # detached also where nothing is reduced (NeMo RL then returns x itself, still tracked)
        return group_all_reduce_sum_with_grad(x, group).detach()


__all__ = [
    "AllGatherCPTensor",
    "_get_tokens_on_this_cp_rank",
    "allgather_cp_sharded_tensor",
    "cp_load_balanced_to_contiguous",
    "cp_shift_next",
    "group_all_reduce_sum",
    "group_all_reduce_sum_with_grad",
]
