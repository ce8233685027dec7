"""How the replicas of a FUSED data-parallel table exchange their row gradients (one backward).

Each rank holds its own rows' gradient; every rank must end with the same summed gradient of every
row any rank touched, then apply the same fused optimizer step (``replicated_fused_lookup``). Two
ways, chosen by :func:`prefers_dense` from the ranks' counts of touched rows (which every rank knows
alike, so all take the same way):

- sparse: every rank's touched rows and gradients in one gather (:func:`all_gather_blocks`: through
  the shared-memory exchange where it is on, else on gloo point-to-point transfers or an all-gather)
  of ``world x max(touched) x (dim + 2)`` 4-byte words and the counts before it. A table whose
  :class:`DenseRowExchange` buffer is at most ``SCRATCH_LIMIT_BYTES`` (:func:`uses_scratch`) keeps
  per-row marks across backwards (:meth:`DenseRowExchange.touched`,
  :func:`shardkit.kernels.replica_grad.touched_rows`): its touched rows are the marked ones (no sort
  of the ids), their gradient is scattered straight into this rank's block of the wire buffer in id
  order (each id's target: its row's position among the touched rows, a kept map;
  :func:`shardkit.kernels.replica_grad.grad_scatter`), the counts ride in the gather sized by the last
  exchange's counts (:func:`gather_bound`; a rank that outgrows it makes every rank gather again), one
  fused backward steps every gathered row reading the gradients where they landed (no concatenation of
  gradients) and the wire buffer is reused (a fresh buffer of that size costs page faults every step);
  a larger table sorts its touched rows (``torch.unique``) and exchanges them the same way, in the
  same kept wire buffer (:func:`rows_of_all_ranks`, fresh buffers, serves only the backward that also
  gives the per-sample weights' gradient);
- dense (:class:`DenseRowExchange`): one all-reduce of a reused fp32 buffer holding the table's
  gradient ``[rows, dim]``, a touched flag per row and each rank's count (``rows x (dim + 1) +
  world`` words), the counts telling the next backward which way to take without a counts gather.
  With the shared-memory exchange on (``SHARDKIT_SHM_EXCHANGE=1``, :func:`all_reduce_sum`) the
  scatter writes this rank's term straight into its shared buffer and the sum lands in the kept one:
  no copy of the term, no TCP (gloo's all-reduce of row 45's 131 MB buffer was loopback TCP).
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from shardkit.distributed import shm_exchange
from shardkit.distributed.agreement import all_gather_flat
from shardkit.distributed.gather_blocks import all_gather_into
from shardkit.kernels import embedding_fused_backward
from shardkit.kernels.replica_grad import touched_rows
from shardkit.kernels.row_optimizer import RowOptimizerArgs

# the sparse way marks its touched rows in kept per-row arrays (DenseRowExchange.touched, marks and
# position: 9 bytes a row) for tables whose dense exchange buffer would be at most this big; a larger table
# sorts its touched rows instead
SCRATCH_LIMIT_BYTES = 256 << 20


# the kept wire buffer is made again (smaller) when a gather needs less than 1 / WIRE_SHRINK of it:
# kept across the small swings of the touched rows (gather_bound's slack is 1/16), given back after
# a lasting drop (a smaller batch)
WIRE_SHRINK = 4


def uses_scratch(num_rows: int, dim: int, world: int) -> bool:
    """Whether a table of ``[num_rows, dim]`` replicated on ``world`` ranks takes the sparse way with
    the kept :class:`DenseRowExchange` parts (its dense buffer, ``rows x (dim + 1) + world`` fp32
    values, at most ``SCRATCH_LIMIT_BYTES``); a larger table sorts its touched rows instead."""
    return 4 * (num_rows * (dim + 1) + world) <= SCRATCH_LIMIT_BYTES


def gather_bound(counts: List[int]) -> int:
    """The rows per rank the next sparse gather makes room for, from the last exchange's ``counts``
    (every rank's, known alike): their largest and 1/16 more, so that the ranks' counts ride in that
    gather (no counts gather first) unless a rank touches more rows than that."""
    most = max(counts, default=0)
    return most + most // 16 + 1


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


def all_gather_blocks(out: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Every rank's block of ``out`` (1-D, one equal block per rank of ``group`` in rank order, this
    rank's filled in) to every rank: :func:`shardkit.distributed.gather_blocks.all_gather_into`,
    through the shared-memory exchange where it serves the group, else on gloo point to point
    whatever the size (gloo's all-gather ran 2-3x slower than these transfers for the 10-30 MB blocks
    of the 2-rank CPU sweep; this rank's block is in place, so nothing is copied)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    size = out.numel() // world
    if size == 0 or world == 1:
        return
    all_gather_into(out, out[me * size : (me + 1) * size], group=group, min_bytes=0)


def all_reduce_sum(
    buffer: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    fill: Optional[Callable[[torch.Tensor], None]] = None,
) -> None:
    """Sum contiguous ``buffer`` over the ranks of ``group`` in place: through the shared-memory
    exchange where it is on and serves the group (CPU, gloo, one host: summed in rank order), else
    ``dist.all_reduce``. ``fill(out)``: this rank's term is what it writes into ``out`` (every element;
    ``out`` is ``buffer`` or this rank's shared buffer, where the peers read it without a copy)."""
    if buffer.device.type == "cpu" and shm_exchange.shm_exchange_enabled():
        exchange = shm_exchange.exchange_for(dist.group.WORLD if group is None else group)
        if exchange is not None:
            exchange.all_reduce_sum(buffer, fill).wait()
            return
    if fill is not None:
        fill(buffer)
    dist.all_reduce(buffer, group=group)


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
    got = torch.empty(world, most * (dim + 2), dtype=torch.int32, device=grad.device)
    send = got[dist.get_rank(group)]  # the padding past each count is never read
    send[: 2 * count] = rows.view(torch.int32)
    send[2 * most : 2 * most + count * dim] = grad.reshape(-1).view(torch.int32)
    all_gather_blocks(got.view(-1), group)
    got_rows = torch.cat([got[r, : 2 * c] for r, c in enumerate(counts)]).view(torch.int64)
    got_grad = torch.cat([got[r, 2 * most : 2 * most + c * dim] for r, c in enumerate(counts)])
    return got_rows, got_grad.view(torch.float32).view(-1, dim)


class DenseRowExchange:
    """The dense way's reused fp32 buffer of ``rows x (dim + 1) + world`` words: the table's gradient
    ``[rows, dim]`` (:attr:`grad`), a touched flag per row (:attr:`flags`) and one count slot per
    rank, summed over the ranks by one all-reduce (:meth:`all_reduce_and_step`); and the sparse
    way's kept parts (:meth:`gather`, :meth:`step_gathered`): a touched mark per row
    (:attr:`marks`, bool, all False between backwards), a row -> position map (:attr:`position`,
    :meth:`touched`) and the wire buffer.

    Kept across backwards (a fresh buffer of the table's size costs page faults every step). The
    dense buffer is made on the first dense backward (a table that stays sparse never holds it).
    Between backwards its flags and counts are zero (each step clears what it wrote); its gradient
    rows are zero too after a step that touched few rows (cleared row by row), while after one that
    touched most of them they are left as they are: the next writer either sets every row itself
    (the scatter, ``start(zero_grad=False)``) or has :meth:`start` zero them first. :meth:`start`
    also zeroes what a backward that did not finish left written.
    """

    def __init__(self, num_rows: int, dim: int, world: int, device: torch.device) -> None:
        self.num_rows, self.dim, self.world, self.device = num_rows, dim, world, device
        self.buffer: Optional[torch.Tensor] = None  # made by start()
        # what of the buffer is zero: the flags and counts (the tail), the gradient rows
        self._tail_clean = self._grad_clean = True
        # the sparse way's kept scratch (touched_rows): all False between backwards
        self.marks: Optional[torch.Tensor] = None  # made by touched() (a sorting table never holds it)
        # the sparse way's gather: every rank's block, this rank's written in place (grown when too
        # small, made again when over WIRE_SHRINK times what a gather needs)
        self._wire = torch.empty(0, dtype=torch.int32, device=device)
        self._gathered = (0, 0, 0)  # the last gather's (head, slots, width)
        self.position: Optional[torch.Tensor] = None  # buffer row -> its index among the touched rows

    def words(self) -> int:
        """fp32 words of the dense buffer: ``rows x (dim + 1) + world``."""
        return self.num_rows * (self.dim + 1) + self.world

    def fits(self, num_rows: int, dim: int, world: int, device: torch.device) -> bool:
        """Whether this buffer serves a table of these sizes on ``device``."""
        return (num_rows, dim, world, device) == (self.num_rows, self.dim, self.world, self.device)

    def start(self, zero_grad: bool = True) -> None:
        """Make sure the dense buffer exists with its flags and counts zero (and, when ``zero_grad``,
        its gradient rows) before this rank writes its gradient, flags and count into it: a memset
        only of what the last backward left written. ``zero_grad=False``: the writer
        (:func:`shardkit.kernels.replica_grad.grad_scatter`) sets every gradient row itself."""
        if self.buffer is None:
            rows, dim = self.num_rows, self.dim
            self.buffer = torch.zeros(self.words(), dtype=torch.float32, device=self.device)
            self.grad, self.flags, self.counts = self.parts(self.buffer)
            self._tail = self.buffer[rows * dim :]
            self._ends = torch.zeros(rows + 1, dtype=torch.int64, device=self.device)
        else:
            if not self._tail_clean:
                self._tail.zero_()
            if zero_grad and not self._grad_clean:
                self.grad.zero_()
        self._tail_clean = False
        self._grad_clean = False

    def parts(self, buffer: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(grad [rows, dim], flags [rows], counts [world])``: views of a flat fp32 ``buffer`` of the
        dense buffer's layout."""
        rows, dim = self.num_rows, self.dim
        grad = buffer[: rows * dim].view(rows, dim)
        return grad, buffer[rows * dim : rows * (dim + 1)], buffer[rows * (dim + 1) :]

    def touched(
        self, ids: torch.Tensor, offsets: torch.Tensor, bag_shift: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The sparse way's distinct sorted touched buffer rows (int64 ``[U]``) of the lookup's ids,
        read off the kept marks (no sort); :attr:`position` maps each to its index among them."""
        if self.position is None:
            self.marks = torch.zeros(self.num_rows, dtype=torch.bool, device=self.device)
            self.position = torch.empty(self.num_rows, dtype=torch.int64, device=self.device)
        return touched_rows(self.marks, self.position, ids, offsets, bag_shift)

    def mark(self, rows: torch.Tensor, rank: int) -> None:
        """Flag this rank's touched buffer ``rows`` (int64, repeats allowed) and write its count of
        distinct rows into its slot (no host sync)."""
        self.flags.index_fill_(0, rows, 1.0)
        self.counts[rank] = self.flags.sum()

    def all_reduce_and_step(
        self,
        weight: torch.Tensor,
        step: RowOptimizerArgs,
        group: Optional[dist.ProcessGroup],
        fill: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = None,
    ) -> List[int]:
        """Sum the buffer over the ranks, then apply ``step`` to every row some rank touched, with its
        summed gradient. Returns every rank's count of touched rows, rank 0's first.

        ``fill(grad, flags, counts)``: instead of the buffer's contents (written by the caller after
        :meth:`start`), this rank's term is what it writes into :meth:`parts` of the buffer the sum
        reads it from (every gradient row; the flags and counts arrive zero), made by
        :func:`all_reduce_sum` straight in the shared buffer when the exchange is on."""
        if fill is None:
            all_reduce_sum(self.buffer, group)
        else:
            self.start(zero_grad=False)  # the kept buffer exists; it receives the sum

            def write(out: torch.Tensor) -> None:
                grad, flags, counts = self.parts(out)
                if out.data_ptr() != self.buffer.data_ptr():  # a shared buffer: its last call's bytes
                    flags.zero_()
                    counts.zero_()
                fill(grad, flags, counts)

            all_reduce_sum(self.buffer, group, write)
        counts = [int(c) for c in self.counts.tolist()]
        self.step_flagged(weight, step)
        return counts

    def gather(
        self,
        rows: torch.Tensor,
        most: int,
        group: Optional[dist.ProcessGroup],
        fill: Callable[[torch.Tensor], None],
    ) -> List[int]:
        """The sparse way's one all-gather: every rank's count of touched rows and, when at most
        ``most`` (the same on every rank), its rows and gradient rows; returns every rank's count,
        rank 0's first (a caller seeing one above ``most`` gathers again with the largest).

        ``rows``: this rank's distinct sorted touched rows (int64 ``[U]``); ``fill(out)`` writes their
        gradient into ``out`` (fp32 ``[U, dim]``, a view of the wire buffer). A rank's block of the
        wire buffer, in units of ``dim`` words: ``head`` of them holding its count and rows as int64
        (two int32 words each; padded so that every block starts on an 8-byte boundary), then
        ``most`` gradient rows (fp32 bits) of which its count are sent; the padding is never read."""
        world = self.world
        head, slots, width = self.gather_layout(most)
        if not world * width <= self._wire.numel() <= WIRE_SHRINK * world * width:
            self._wire = torch.empty(world * width, dtype=torch.int32, device=rows.device)
        got = self._wire[: world * width]
        me = dist.get_rank(group)
        self.write_block(got[me * width : (me + 1) * width], rows, most, head, fill)
        all_gather_blocks(got, group)
        self._gathered = (head, slots, width)
        return got.view(world, width)[:, :2].view(torch.int64).squeeze(1).tolist()

    def gather_layout(self, most: int) -> Tuple[int, int, int]:
        """``(head, slots, width)`` of a rank's block of a gather making room for ``most`` rows
        (:meth:`gather`): ``head`` units of ``dim`` words of count and rows, ``slots`` units in all,
        ``width`` words (even: the int64 words of every block stay on 8-byte boundaries)."""
        head = -(-(2 + 2 * most) // self.dim)
        head += (head + most) * self.dim % 2  # an even block: int64 words at 8-byte boundaries
        slots = head + most
        return head, slots, slots * self.dim

    def write_block(
        self,
        send: torch.Tensor,
        rows: torch.Tensor,
        most: int,
        head: int,
        fill: Callable[[torch.Tensor], None],
    ) -> None:
        """This rank's block (int32 ``[width]``; ``head``: of :meth:`gather_layout` of ``most``) of a
        gather: its count, and, when at most ``most``, its rows and (``fill``) their gradient rows."""
        count, dim = rows.numel(), self.dim
        send[:2].view(torch.int64).fill_(count)
        if count <= most:
            send[2 : 2 + 2 * count].copy_(rows.view(torch.int32))
            fill(send[head * dim : (head + count) * dim].view(torch.float32).view(count, dim))

    def step_gathered(
        self,
        rows: torch.Tensor,
        counts: List[int],
        weight: torch.Tensor,
        step: RowOptimizerArgs,
        gathered: Optional[Tuple[torch.Tensor, int]] = None,
    ) -> None:
        """After :meth:`gather` (``counts``: its result, none above its ``most``; ``rows``: this
        rank's touched rows, whose gradient went straight to the wire), apply ``step`` to every
        gathered row with its gradients summed in rank order (rank 0's first: the same sum, bit for
        bit, on every rank) by ONE fused backward reading the gradient rows where they landed: the
        wire buffer as ``[world x slots, dim]`` bags, bag ``(r, head + i)`` holding rank r's i-th row
        and every other bag nothing. ``gathered``: ``(wire, most)``, the blocks of a gather made
        elsewhere (:func:`gather_groups`: int32 ``[world x width]`` of :meth:`gather_layout` of
        ``most``) instead of this exchange's last :meth:`gather`."""
        if gathered is None:
            head, slots, width = self._gathered
            got = self._wire[: self.world * width]
        else:
            got, most = gathered
            head, slots, width = self.gather_layout(most)
        pieces = [got[r * width + 2 : r * width + 2 + 2 * c] for r, c in enumerate(counts)]
        ids = torch.cat(pieces).view(torch.int64)
        ends = torch.zeros(self.world * slots + 1, dtype=torch.int64, device=rows.device)
        for r, c in enumerate(counts):
            ends[1 + r * slots + head : 1 + r * slots + head + c] = 1
        ends.cumsum_(0)
        grads = got.view(torch.float32).view(self.world * slots, self.dim)
        embedding_fused_backward(weight, ids, ends, None, None, None, grads, True, step)

    def step_flagged(self, weight: torch.Tensor, step: RowOptimizerArgs) -> None:
        """Apply ``step`` to every flagged row with its gradient in :attr:`grad` (the kernel backend's
        fused backward, one bag per row, no copy of the gradient), then zero the buffer again."""
        touched = self.flags > 0
        rows = touched.nonzero().squeeze(1)
        # bag r holds row r when some rank touched it, else nothing: grad row r is bag r's gradient
        torch.cumsum(touched, 0, out=self._ends[1:])
        embedding_fused_backward(weight, rows, self._ends, None, None, None, self.grad, True, step)
        self._clear(rows)

    def _clear(self, rows: torch.Tensor) -> None:
        """Zero the flags and counts again, and the gradient where only ``rows`` (int64) hold it;
        when more rows hold it, the gradient is left for the next backward that needs it zero
        (one that sets every row itself, :meth:`start` ``zero_grad=False``, needs no memset)."""
        if 6 * rows.numel() >= self.num_rows:  # one memset beats per-row fills from about 1 row in 6
            self._tail.zero_()
            self._grad_clean = False
        else:
            self.grad.index_fill_(0, rows, 0.0)
            self.flags.index_fill_(0, rows, 0.0)
            self.counts.zero_()
            self._grad_clean = True
        self._tail_clean = True


class GroupGather(NamedTuple):
    """One group's part in :func:`gather_groups`: its exchange, this rank's distinct sorted touched
    rows (int64 ``[U]``), the rows per rank to make room for, and the writer of their gradient."""

    exchange: DenseRowExchange
    rows: torch.Tensor
    most: int
    fill: Callable[[torch.Tensor], None]


class GatherWire:
    """A kept buffer of 4-byte words for the joint collectives (:func:`gather_groups`; read as fp32
    by :func:`all_reduce_groups`): a fresh one every backward would cost page faults past glibc's
    mmap threshold."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.int32)

    def take(self, words: int, device: torch.device) -> torch.Tensor:
        """int32 ``[words]`` on ``device``: the kept buffer's start, made again when too small or over
        ``WIRE_SHRINK`` times ``words``."""
        if self.buffer.device != device or not words <= self.buffer.numel() <= WIRE_SHRINK * words:
            self.buffer = torch.empty(words, dtype=torch.int32, device=device)
        return self.buffer[:words]


def gather_groups(
    parts: Sequence[GroupGather], group: Optional[dist.ProcessGroup], wire: GatherWire
) -> List[Tuple[List[int], torch.Tensor]]:
    """Several groups' sparse gathers (:meth:`DenseRowExchange.gather`) as ONE all-gather: a rank's
    block holds each group's block in turn. Returns per group every rank's count (rank 0's first) and
    its blocks (an int32 ``[world, width]`` view; ``reshape(-1)`` of it is what
    :meth:`DenseRowExchange.step_gathered` reads): the same words its own gather would have given."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    layouts = [part.exchange.gather_layout(part.most) for part in parts]
    total = sum(width for _, _, width in layouts)
    got = wire.take(world * total, parts[0].rows.device)
    start = me * total
    for part, (head, _, width) in zip(parts, layouts):
        part.exchange.write_block(got[start : start + width], part.rows, part.most, head, part.fill)
        start += width
    all_gather_blocks(got, group)
    blocks = got.view(world, total)
    out, start = [], 0
    for _, _, width in layouts:
        mine = blocks[:, start : start + width]
        out.append((mine[:, :2].view(torch.int64).squeeze(1).tolist(), mine))
        start += width
    return out


# the dense way's buffers at most this many bytes are all-reduced together (all_reduce_groups): the copy
# back into each buffer costs little there, and a larger buffer's all-reduce is its bytes, not its call
JOINT_DENSE_BYTES = 1 << 20


class GroupAllReduce(NamedTuple):
    """One group's part in :func:`all_reduce_groups`: its exchange, its replica buffer, its step, and
    the writer of this rank's term (``fill(grad, flags, counts)``, as for
    :meth:`DenseRowExchange.all_reduce_and_step`)."""

    exchange: DenseRowExchange
    weight: torch.Tensor
    step: RowOptimizerArgs
    fill: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def all_reduce_groups(
    parts: Sequence[GroupAllReduce], group: Optional[dist.ProcessGroup], wire: GatherWire
) -> List[List[int]]:
    """Several groups' dense ways (:meth:`DenseRowExchange.all_reduce_and_step`) as ONE all-reduce of
    their buffers side by side; each buffer gets its sum back and steps its touched rows. The sums
    are the ones each buffer's own all-reduce makes (element by element, in rank order through the
    shared-memory exchange). Returns per group every rank's count of touched rows."""
    sizes = [part.exchange.words() for part in parts]
    joint = wire.take(sum(sizes), parts[0].weight.device).view(torch.float32)
    for part in parts:
        part.exchange.start(zero_grad=False)  # its buffer exists; it receives the sum below

    def write(out: torch.Tensor) -> None:
        start = 0
        for part, size in zip(parts, sizes):
            grad, flags, counts = part.exchange.parts(out[start : start + size])
            flags.zero_()  # the joint buffer (or a shared one) holds its last call's bytes
            counts.zero_()
            part.fill(grad, flags, counts)
            start += size

    all_reduce_sum(joint, group, write)
    out, start = [], 0
    for part, size in zip(parts, sizes):
        part.exchange.buffer.copy_(joint[start : start + size])
        out.append([int(c) for c in part.exchange.counts.tolist()])
        part.exchange.step_flagged(part.weight, part.step)
        start += size
    return out


__all__ = [
    "DenseRowExchange",
    "GatherWire",
    "GroupAllReduce",
    "JOINT_DENSE_BYTES",
    "all_reduce_groups",
    "GroupGather",
    "gather_groups",
    "all_gather_blocks",
    "SCRATCH_LIMIT_BYTES",
    "WIRE_SHRINK",
    "gather_bound",
    "gather_counts",
    "prefers_dense",
    "rows_of_all_ranks",
    "uses_scratch",
]
