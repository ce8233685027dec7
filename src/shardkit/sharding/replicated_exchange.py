"""How the replicas of a FUSED data-parallel table exchange their row gradients (one backward).

Each rank holds its own rows' gradient; every rank must end with the same summed gradient of every
row any rank touched, then apply the same fused optimizer step (``replicated_fused_lookup``). Two
ways, chosen by :func:`prefers_dense` from the ranks' counts of touched rows (which every rank knows
alike, so all take the same way):

- sparse (:func:`rows_of_all_ranks`): the counts, then every rank's rows and gradients in one
  all-gather: ``world x max(touched) x (dim + 2)`` 4-byte words;
- dense (:class:`DenseRowExchange`): one all-reduce of a reused fp32 buffer holding the table's
  gradient ``[rows, dim]``, a touched flag per row and each rank's count (``rows x (dim + 1) +
  world`` words), the counts telling the next backward which way to take without a counts gather.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import all_gather_flat
from shardkit.kernels import embedding_fused_backward
from shardkit.kernels.row_optimizer import RowOptimizerArgs


def prefers_dense(counts: List[int], num_rows: int, dim: int) -> bool:
    """True when gathering every rank's ``counts`` touched rows (padded to the largest) moves at least
    as many words as the dense all-reduce of a ``[num_rows, dim]`` gradient with its flags."""
    return len(counts) * max(counts, default=0) * (dim + 2) >= num_rows * (dim + 1)


def gather_counts(
    count: int, device: torch.device, group: Optional[dist.ProcessGroup], world: int
) -> List[int]:
    """Every rank's ``count`` (one all-gather of an int64 each), rank 0's first."""
    counts = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_flat(counts, torch.tensor([count], dtype=torch.int64, device=device), group=group)
    return counts.tolist()


def rows_of_all_ranks(
    rows: torch.Tensor, grad: torch.Tensor, counts: List[int], group: Optional[dist.ProcessGroup]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every rank's sparse row gradients, for each rank to sum: ``(rows int64 [K], grad fp32 [K, D])``,
    rank 0's rows first (a row appears once per rank that sent it), from this rank's distinct sorted
    ``rows`` ``[U]`` and ``grad`` ``[U, D]``; ``counts``: every rank's ``U`` (:func:`gather_counts`).
    Equal on every rank. One all-gather of every rank's rows and gradient rows in one int32 buffer
    padded to the largest count (a row as two int32 words, fp32 bits as one)."""
    dim, world, most = grad.size(1), len(counts), max(counts)
    if most == 0:
        return rows, grad
    # per rank: [2 x most] int32 words of rows, then [most x dim] words of gradient, each padded
    count = rows.numel()
    send = torch.zeros(most * (dim + 2), dtype=torch.int32, device=grad.device)
    send[: 2 * count] = rows.view(torch.int32)
    send[2 * most : 2 * most + count * dim] = grad.reshape(-1).view(torch.int32)
    got = torch.empty(world, most * (dim + 2), dtype=torch.int32, device=grad.device)
    all_gather_flat(got.view(-1), send, group=group)
    got_rows = torch.cat([got[r, : 2 * c] for r, c in enumerate(counts)]).view(torch.int64)
    got_grad = torch.cat([got[r, 2 * most : 2 * most + c * dim] for r, c in enumerate(counts)])
    return got_rows, got_grad.view(torch.float32).view(-1, dim)


class DenseRowExchange:
    """One reused fp32 buffer of ``rows x (dim + 1) + world`` words: the table's gradient ``[rows,
    dim]`` (:attr:`grad`), a touched flag per row (:attr:`flags`) and one count slot per rank, summed
    over the ranks by one all-reduce (:meth:`all_reduce_and_step`).

    Kept across backwards (a fresh buffer of the table's size costs page faults every step) and
    zeroed by :meth:`start`; made only for a table whose rows most steps touch (the dense way), so
    it costs what the table's dense gradient would.
    """

    def __init__(self, num_rows: int, dim: int, world: int, device: torch.device) -> None:
        self.num_rows, self.dim, self.world = num_rows, dim, world
        self.buffer = torch.empty(num_rows * (dim + 1) + world, dtype=torch.float32, device=device)
        self.grad = self.buffer[: num_rows * dim].view(num_rows, dim)
        self.flags = self.buffer[num_rows * dim : num_rows * (dim + 1)]
        self.counts = self.buffer[num_rows * (dim + 1) :]

    def fits(self, num_rows: int, dim: int, world: int, device: torch.device) -> bool:
        """Whether this buffer serves a table of these sizes on ``device``."""
        return (num_rows, dim, world, device) == (self.num_rows, self.dim, self.world, self.buffer.device)

    def start(self) -> None:
        """Zero the buffer before this rank writes its gradient, flags and count into it."""
        self.buffer.zero_()

    def mark(self, rows: torch.Tensor, rank: int) -> None:
        """Flag this rank's touched buffer ``rows`` (int64, repeats allowed) and write its count of
        distinct rows into its slot (no host sync)."""
        self.flags.index_fill_(0, rows, 1.0)
        self.counts[rank] = self.flags.sum()

    def all_reduce_and_step(
        self, weight: torch.Tensor, step: RowOptimizerArgs, group: Optional[dist.ProcessGroup]
    ) -> List[int]:
        """Sum the buffer over the ranks, then apply ``step`` to every row some rank touched, with its
        summed gradient (the kernel backend's fused backward, one bag per row, no copy of the
        gradient). Returns every rank's count of touched rows, rank 0's first."""
        dist.all_reduce(self.buffer, group=group)
        touched = self.flags > 0
        rows = touched.nonzero().squeeze(1)
        # bag r holds row r when some rank touched it, else nothing: grad row r is bag r's gradient
        ends = torch.zeros(self.num_rows + 1, dtype=torch.int64, device=rows.device)
        torch.cumsum(touched, 0, out=ends[1:])
        embedding_fused_backward(weight, rows, ends, None, None, None, self.grad, True, step)
        return [int(c) for c in self.counts.tolist()]


__all__ = ["DenseRowExchange", "gather_counts", "prefers_dense", "rows_of_all_ranks"]
