"""Where each rank's columns land in a pooled all-to-all's output: the concatenation and a column
permutation of the result done as one copy.

A pooled all-to-all receives, from every rank ``r``, a ``[B, D_r]`` block; the plain op concatenates
them along columns in rank order (one copy) and a sharded module then permutes the columns into its
unsharded key order (another copy, and two more in backward). A ``ColumnPlacement`` says, in units of
``width`` columns, which output block each received block goes to, so that the received blocks are
copied straight to their places in forward, and in backward the gradient's blocks straight into the
send buffer. Copies only: the results are bitwise those of the concatenation and permutation.

A rank's blocks move one of three ways (``WAYS``), each giving the same values:

- ``"copier"``: given a ``copier`` (the native ``shardkit.kernels.column_copy.copy_column_ranges``,
  handed over by the sharding layer, which may import kernels) and CPU tensors, contiguous: the blocks
  merged into ranges of consecutive columns, one memcpy per row and range;
- ``"strided"``: the blocks cut into arithmetic runs (table-wise tables placed round-robin give one run
  per rank, stride ``W``), one strided ``copy_`` a run;
- ``"index"``: one ``index_copy_`` / ``index_select`` over all the rank's blocks.

Which is fastest depends on the layout and on the machine, and no fixed rule got it right: a strided
run costs one torch op (4.5 us on an AMD EPYC Zen 4, 8 us on a Zen 3) plus a per row and block cost
that depends on the run's shape (1.2 ns for runs of one block, 3.6 ns for runs of eight, 2048 rows,
Zen 4), the copier ~1.3 us plus 4-9 ns per row and range; the index copy is one op whose per-element
cost grows with the block width (at 32 rows it beat 4-30 strided runs 1.9-8.7x, at 2048 rows of
64-column blocks it took 1.2-1.7x as long: docs/performance.md, twenty-seventh session). So every
way a rank can take on the CPU is timed on the layout itself when the placement is built
(``copy_choice``: a ``place`` and a ``take`` on fp32 matrices at a few row counts, once per layout and
process, kept in :data:`_TRIALS`), and a call on CPU tensors takes the way whose time interpolated at
its row count is least. On other devices (nothing timed there) the strided runs, or the index copy
past ``MAX_RUNS`` runs.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from shardkit.distributed.comm_ops import scratch
from shardkit.distributed.comm_ops.copy_choice import Trial, fastest, time_trials

# off the CPU (no trials): more runs than this go by the index copy
MAX_RUNS = 8
# on the CPU, a rank of more runs than this is not timed strided (a torch op a run: 5-8 us each, so
# a trial of thousands would take seconds) and goes by the copier or the index copy
MAX_TIMED_RUNS = 256
WAYS = ("copier", "strided", "index")
# (width, blocks, a rank's dest, copier) -> its trials of the ways it can take (copy_choice)
_TRIALS: Dict[Tuple[int, int, Tuple[int, ...], Optional[Callable]], Tuple[Trial, ...]] = {}
# the choices a placement made, per (rank, rows, copier allowed), before it stops remembering new ones
_DECIDED_MAX = 4096

Run = Tuple[int, int, int, int]  # (first source block, blocks, first output block, output stride)


def arithmetic_runs(dest: Sequence[int]) -> List[Run]:
    """``dest`` (the output block of each source block) as maximal runs of a constant positive stride."""
    runs: List[Run] = []
    i = 0
    while i < len(dest):
        step = dest[i + 1] - dest[i] if i + 1 < len(dest) else 1
        if step < 1:
            step, j = 1, i + 1
        else:
            j = i + 1
            while j < len(dest) and dest[j] - dest[j - 1] == step:
                j += 1
        runs.append((i, j - i, dest[i], step))
        i = j
    return runs


class ColumnPlacement:
    """The output block (of ``width`` columns) of rank ``r``'s received block ``k``: ``dest[r][k]``.

    ``dest`` must cover every output block exactly once (a permutation of ``range(blocks)``).
    ``copier(dst, src, ranges)``: moves column ranges of CPU matrices (module doc); None: the strided
    copies and the index copy only. Building it times the ways on each rank's blocks
    (:func:`measure_trials`; once per layout and process). Depends on the plan only: built once, not
    per step.
    """

    def __init__(
        self,
        width: int,
        dest: Sequence[Sequence[int]],
        copier: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = None,
    ) -> None:
        self.width = int(width)
        self.dest = [list(d) for d in dest]
        self.blocks = sum(len(d) for d in self.dest)
        if sorted(b for d in self.dest for b in d) != list(range(self.blocks)):
            raise ValueError(f"a column placement must put every output block once, got {self.dest}")
        self._runs = [arithmetic_runs(d) for d in self.dest]
        self._index: Dict[torch.device, List[torch.Tensor]] = {}
        self.copier = copier
        # per rank, int64 [K, 3] (source column, output column, columns) of its received columns: runs
        # of blocks consecutive in both merged; the same rows with the first two swapped for ``take``
        self._ranges: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * len(self.dest)
        # the ways this placement can take on the CPU, in WAYS order; per rank, their times at a few row
        # counts (module doc); per (rank, rows, copier allowed): the way chosen (the hot path's look-up)
        self.ways = WAYS if copier is not None else WAYS[1:]
        self._decided: Dict[Tuple[int, int, bool], str] = {}
        if copier is not None:
            self._ranges = [self._column_ranges(d) for d in self.dest]
        self._trials: List[Tuple[Trial, ...]] = measure_trials(self)

    def _column_ranges(self, dest: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        ranges: List[List[int]] = []
        for k, block in enumerate(dest):
            if ranges and ranges[-1][1] + ranges[-1][2] == block * self.width:
                ranges[-1][2] += self.width
            else:
                ranges.append([k * self.width, block * self.width, self.width])
        # the copier's, a CPU op: on the CPU even under a ``torch.device`` context
        forward = torch.tensor(ranges, dtype=torch.int64, device="cpu").view(-1, 3)
        return forward, forward[:, [1, 0, 2]].contiguous()

    def way(self, rank: int, rows: int, copier_allowed: bool = True) -> str:
        """The way (one of :attr:`ways`) that moves rank ``rank``'s columns of ``rows`` rows of CPU
        tensors: the least time interpolated at ``rows`` (module doc), the copier only where
        ``copier_allowed`` (contiguous tensors)."""
        key = (rank, rows, copier_allowed)
        chosen = self._decided.get(key)
        if chosen is None:
            allowed = [copier_allowed or w != "copier" for w in self.ways]
            chosen = self.ways[fastest(self._trials[rank], rows, allowed)]
            if len(self._decided) < _DECIDED_MAX:
                self._decided[key] = chosen
        return chosen

    def _way_for(self, rank: int, *tensors: torch.Tensor) -> str:
        """The way for these tensors: timed on the CPU; elsewhere the strided runs, or the index copy
        past ``MAX_RUNS`` runs."""
        if all(t.device.type == "cpu" for t in tensors):
            return self.way(rank, tensors[0].size(0), all(t.is_contiguous() for t in tensors))
        return "index" if len(self._runs[rank]) > MAX_RUNS else "strided"

    def columns(self, rank: int) -> int:
        """Columns rank ``rank`` sends."""
        return len(self.dest[rank]) * self.width

    def _indexes(self, device: torch.device) -> List[torch.Tensor]:
        if device not in self._index:
            self._index[device] = [torch.tensor(d, dtype=torch.int64, device=device) for d in self.dest]
        return self._index[device]

    def assemble(self, pieces: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
        """Received flat pieces (rank ``r``'s: ``rows x columns(r)`` values, row-major) ->
        ``[rows, blocks * width]``, a ``comm_ops.scratch`` buffer."""
        out = scratch.new_empty(pieces[0], rows, self.blocks * self.width)
        for r, piece in enumerate(pieces):
            self.place(out, r, piece)
        return out

    def place(self, out: torch.Tensor, rank: int, piece: torch.Tensor) -> None:
        """Copy rank ``rank``'s received piece (``rows x columns(rank)`` values, row-major, any shape)
        to its columns of ``out`` (``[rows, blocks * width]``, contiguous)."""
        rows = out.size(0)
        if rows == 0 or not self.dest[rank]:
            return
        self._PLACE[self._way_for(rank, out, piece)](self, out, rank, piece)

    def _place_copier(self, out: torch.Tensor, rank: int, piece: torch.Tensor) -> None:
        rows = out.size(0)
        self.copier(out.view(rows, -1), piece.view(rows, -1), self._ranges[rank][0])

    def _place_strided(self, out: torch.Tensor, rank: int, piece: torch.Tensor) -> None:
        rows = out.size(0)
        out_blocks = out.view(rows, self.blocks, self.width)
        src = piece.view(rows, len(self.dest[rank]), self.width)
        for s0, n, d0, step in self._runs[rank]:
            out_blocks[:, d0 : d0 + (n - 1) * step + 1 : step].copy_(src[:, s0 : s0 + n])

    def _place_index(self, out: torch.Tensor, rank: int, piece: torch.Tensor) -> None:
        rows = out.size(0)
        src = piece.view(rows, len(self.dest[rank]), self.width)
        out.view(rows, self.blocks, self.width).index_copy_(1, self._indexes(out.device)[rank], src)

    def take(self, grad: torch.Tensor, rank: int, chunk: torch.Tensor, divisor: int = 1) -> None:
        """Copy rank ``rank``'s columns of ``grad`` (``[rows, blocks * width]``, contiguous) into
        ``chunk`` (``rows x columns(rank)`` values, contiguous, any shape): :meth:`place`'s inverse.
        ``divisor`` > 1: divided by it on the way (``torch.div``'s values, as ``div_`` after the copy)."""
        if grad.size(0) == 0 or not self.dest[rank]:
            return
        self._TAKE[self._way_for(rank, grad, chunk)](self, grad, rank, chunk, divisor)

    def _take_copier(self, grad: torch.Tensor, rank: int, chunk: torch.Tensor, divisor: int = 1) -> None:
        rows = grad.size(0)
        self.copier(chunk.view(rows, -1), grad.view(rows, -1), self._ranges[rank][1])
        if divisor > 1:
            chunk.div_(divisor)

    def _take_strided(self, grad: torch.Tensor, rank: int, chunk: torch.Tensor, divisor: int = 1) -> None:
        rows = grad.size(0)
        grad_blocks = grad.view(rows, self.blocks, self.width)
        chunk_blocks = chunk.view(rows, len(self.dest[rank]), self.width)
        for s0, n, d0, step in self._runs[rank]:
            src = grad_blocks[:, d0 : d0 + (n - 1) * step + 1 : step]
            if divisor > 1:
                torch.div(src, divisor, out=chunk_blocks[:, s0 : s0 + n])
            else:
                chunk_blocks[:, s0 : s0 + n].copy_(src)

    def _take_index(self, grad: torch.Tensor, rank: int, chunk: torch.Tensor, divisor: int = 1) -> None:
        rows = grad.size(0)
        grad_blocks = grad.view(rows, self.blocks, self.width)
        chunk_blocks = chunk.view(rows, len(self.dest[rank]), self.width)
        torch.index_select(grad_blocks, 1, self._indexes(grad.device)[rank], out=chunk_blocks)
        if divisor > 1:
            chunk_blocks.div_(divisor)

    # each way's place and take (WAYS' names), looked up per call without building a name
    _PLACE = {"copier": _place_copier, "strided": _place_strided, "index": _place_index}
    _TAKE = {"copier": _take_copier, "strided": _take_strided, "index": _take_index}

    def split(self, grad: torch.Tensor) -> List[torch.Tensor]:
        """Gradient ``[rows, blocks * width]`` -> each rank's ``[rows, columns(r)]`` blocks, back to back
        in one buffer (rank order, a ``comm_ops.scratch`` buffer of ``grad.numel()`` elements of its
        dtype), so that the all-to-all sends them without another copy."""
        return self._split(grad)[1]

    def split_flat(self, grad: torch.Tensor) -> torch.Tensor:
        """:meth:`split`'s buffer itself: ``[rows * blocks * width]``, rank ``r``'s ``rows x columns(r)``
        block (row-major) after those of the ranks before it."""
        return self._split(grad)[0]

    def _split(self, grad: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        grad = grad.contiguous()
        rows = grad.size(0)
        send = scratch.new_empty(grad, grad.numel())
        chunks, start = [], 0
        for r, dest in enumerate(self.dest):
            numel = rows * len(dest) * self.width
            chunk = send[start : start + numel].view(rows, len(dest) * self.width)
            start += numel
            chunks.append(chunk)
            self.take(grad, r, chunk)
        return send, chunks


def measure_trials(placement: ColumnPlacement) -> List[Tuple[Trial, ...]]:
    """Per rank of ``placement``: the seconds of each of its :attr:`~ColumnPlacement.ways` for one
    ``place`` and one ``take`` of the rank's blocks (a step's forward and backward), fp32 CPU tensors,
    at ``copy_choice.TRIAL_ROWS`` (``copy_choice.time_trials``). Kept per layout in :data:`_TRIALS`, so
    that one process times a layout once; a rank with no blocks has no trials (nothing to move)."""
    trials = []
    for rank, dest in enumerate(placement.dest):
        key = (placement.width, placement.blocks, tuple(dest), placement.copier)
        if key not in _TRIALS:
            _TRIALS[key] = (
                time_trials(trial_ways(placement, rank), 4 * placement.blocks * placement.width)
                if dest
                else ()
            )
        trials.append(_TRIALS[key])
    return trials


def trial_ways(placement: ColumnPlacement, rank: int) -> Callable[[int], List[Optional[Callable[[], None]]]]:
    """``make_ways(rows)`` for ``copy_choice.time_trials``: per way of ``placement.ways``, one ``place``
    and one ``take`` of rank ``rank``'s blocks on fp32 CPU matrices of ``rows`` rows (None: strided
    past ``MAX_TIMED_RUNS`` runs, not timed)."""

    def make(rows: int) -> List[Optional[Callable[[], None]]]:
        # on the CPU explicitly: a module built under a ``torch.device("meta")`` context times real copies
        out = torch.zeros(rows, placement.blocks * placement.width, device="cpu")
        piece = torch.zeros(rows * placement.columns(rank), device="cpu")

        def trial(way: str) -> Optional[Callable[[], None]]:
            if way == "strided" and len(placement._runs[rank]) > MAX_TIMED_RUNS:
                return None
            place, take = ColumnPlacement._PLACE[way], ColumnPlacement._TAKE[way]

            def call() -> None:
                place(placement, out, rank, piece)
                take(placement, out, rank, piece)

            return call

        return [trial(way) for way in placement.ways]

    return make


__all__ = [
    "MAX_RUNS",
    "MAX_TIMED_RUNS",
    "WAYS",
    "ColumnPlacement",
    "arithmetic_runs",
    "measure_trials",
    "trial_ways",
]
