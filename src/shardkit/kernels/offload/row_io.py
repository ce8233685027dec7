"""Positioned reads and writes of whole rows of a backing file's fields (``preadv`` / ``pwritev``).

Why not the mapping: a row read through the mapped file costs a page fault per scattered row (and per
field), maps the fault-around window of pages around it, and those pages must be unmapped again
(``madvise``) to keep the resident set bounded. A positioned read copies the row's bytes straight from
the page cache into a buffer of this process: one system call per *run* of consecutive rows (adjacent
rows are coalesced into one call), nothing mapped, nothing to drop. Both views of the file share the
page cache, so what one writes the other reads (Linux: the page cache is unified).

:class:`FileRowIO` reads ``rows`` (ascending int64 ``[n]``, host) of a field into a new host tensor
``[n, *width]`` and writes such a tensor back; bytes are copied verbatim, so values are bitwise those of
the mapped tensor.

Dense misses are the exception: a page fault maps the kernel's fault-around window (64 KiB) of cached
pages, so when many missed rows share windows (a narrow field such as row-wise Adagrad's one float a
row, or a large share of a small table) one fault serves many rows and beats one call per run. Given
the mapped tensors, :meth:`FileRowIO.read_fields` counts per field the windows the rows touch and reads
through the mapping when that is under half the runs, at most ``MAPPED_WINDOWS`` windows between
calls of ``drop`` (which unmaps them): the resident set stays bounded as before.

:meth:`FileRowIO.read_into` / :meth:`FileRowIO.write_from` move rows straight between the file and
given slots of the cache's buffers. With the native kernels built (``csrc/row_io.cpp``) that is one C++
loop of ``preadv`` / ``pwritev`` calls (one per run of adjacent rows and field, any slots; runs at most
:attr:`FileRowIO.merge_gap` bytes apart share a call, the gap read into a throw-away buffer, or, for a
write, read first and written back unchanged through a scratch span of at most 1 MiB), the GIL
released, no Python per run; otherwise (``SHARDKIT_NATIVE=0``, no compiler,
``kernel_backend("torch")``) the pure-Python path above, at most ``PIECE_BYTES`` of rows at a time into
a temporary then ``index_copy_``. Both leave bitwise the same bytes.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from shardkit.kernels.embedding import native_for

READ_THREADS_ENV = "SHARDKIT_OFFLOAD_READ_THREADS"


def read_threads_default() -> int:
    """Threads a native read of many rows runs on: ``$SHARDKIT_OFFLOAD_READ_THREADS`` (an int >= 1), else
    2 where the machine has two cores or more (a step's misses read in two halves at once: the page
    cache's per-call cost, ~1-2 us a row, is what a miss costs), else 1. Raises ValueError for a bad
    value."""
    value = os.environ.get(READ_THREADS_ENV, "").strip()
    if not value:
        return 2 if (os.cpu_count() or 1) >= 2 else 1
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"${READ_THREADS_ENV} must be an int >= 1 (threads), got {value!r}")
    return threads


# the kernel's default fault-around window: what one page fault on a cached file maps
FAULT_AROUND_BYTES = 64 << 10
# windows read through the mapping between two drops (4 MiB mapped at most: the 10x-budget run of
# benchmarks.offload peaked 10 MiB higher at 256 windows, over its budget; 5-10% more CPU per step)
MAPPED_WINDOWS = 64
# the pure-Python read_into / write_from move at most this many bytes of rows through one temporary
PIECE_BYTES = 4 << 20
# native path: extents at most this many bytes apart in the file go in one system call, the gap moved
# too (read into a throw-away buffer; written back as read, through a read of the span first). A call
# costs about what copying 4-16 KiB of page cache does (measured: one preadv of a 4-byte row 0.2-0.7 us
# of CPU, a pwritev 0.5-0.6 us; 4096: 0.15-0.2 us a row either way for a narrow field such as
# row-wise Adagrad's state, where a step's misses lie a few hundred bytes apart; 16 KiB: slower)
MERGE_GAP_BYTES = 4096

# (byte offset of the field's region, shape [R, *width], dtype)
FieldRegion = Tuple[int, Tuple[int, ...], torch.dtype]


def advise_random(fd: int) -> bool:
    """Tell the kernel that ``fd`` reads rows at random (``POSIX_FADV_RANDOM``): no readahead.

    Why: a read of a page that is not in the page cache otherwise brings in a readahead window of its
    neighbours (for one 256-byte row, up to hundreds of KiB of the file that no miss asked for) and
    caches it as large folios, and a small ``pwritev`` into a large folio costs in proportion to the
    folio (ext4 walks all its blocks): a dirty 256-byte row written back cost 6.4 us of CPU into a
    page cache filled through an unadvised descriptor, 2.5 us with the advice (loaded machine, 5300
    rows of a 1e6 x 64 fp32 table). Returns whether the advice was given (not on every OS).
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError:  # a file system without the advice: only slower
        return False
    return True


def row_runs(rows: torch.Tensor) -> Tuple[List[int], List[int], List[int]]:
    """Runs of consecutive rows in ascending ``rows`` (int64 ``[n]``, host).

    Returns three lists of equal length: the position in ``rows`` where each run starts, its length,
    and its first row. ``rows = [3, 4, 5, 9, 11, 12]`` -> ``[0, 3, 4], [3, 1, 2], [3, 9, 11]``.
    """
    n = rows.numel()
    if n == 0:
        return [], [], []
    breaks = (rows[1:] != rows[:-1] + 1).nonzero().flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    lengths = torch.cat([starts[1:], torch.tensor([n])]) - starts
    return starts.tolist(), lengths.tolist(), rows.index_select(0, starts).tolist()


class FileRowIO:
    """Row reads / writes of the fields of one backing file, by file descriptor.

    Args:
        fd: an open read-write descriptor of the file (owned by the caller, kept open while in use).
        regions: field name -> (byte offset, shape ``[R, *width]``, dtype).
        path: the file's name, for error messages.
        mapped, drop: optional: the fields' tensors mapped on the same file and a function unmapping
            their pages; with them, dense reads go through the mapping (see the module docstring).
    """

    def __init__(
        self,
        fd: int,
        regions: Mapping[str, FieldRegion],
        path: str = "?",
        mapped: Optional[Mapping[str, torch.Tensor]] = None,
        drop: Optional[Callable[[], None]] = None,
    ) -> None:
        self.fd = fd
        # the fields' mapped tensors and what unmaps their pages: dense reads go through them
        self.mapped = dict(mapped) if mapped is not None and drop is not None else {}
        self.drop = drop
        self.path = path
        # read_into / write_from's default path: "auto", "native" or "torch"
        self.backend = "auto"
        # native path: gaps of at most this many bytes are moved with their neighbours (0: never)
        self.merge_gap = MERGE_GAP_BYTES
        # native path: a read of many rows runs on up to this many threads (read_threads_default), each
        # for at least 128 system calls; the last native read ran on last_read_threads (tests)
        self.read_threads = read_threads_default()
        self.last_read_threads = 0
        self.regions: Dict[str, FieldRegion] = dict(regions)
        self._row_bytes = {
            name: math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
            for name, (_, shape, dtype) in self.regions.items()
        }

    def read_fields(self, rows: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Every field's ``rows`` (ascending int64 ``[n]``, host): name -> new tensor ``[n, *width]``."""
        runs = row_runs(rows)
        out = {}
        for name in self.regions:
            if name in self.mapped and self._faults_are_cheaper(name, rows, len(runs[0])):
                out[name] = self._read_mapped(name, rows)
            else:
                out[name] = self._read(name, rows.numel(), runs)
        return out

    def _windows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        offset = self.regions[name][0]
        return torch.unique_consecutive((offset + rows * self._row_bytes[name]) // FAULT_AROUND_BYTES)

    def _faults_are_cheaper(self, name: str, rows: torch.Tensor, runs: int) -> bool:
        """Whether the fault-around windows ``rows`` touch in field ``name`` are under half its runs."""
        if self._row_bytes[name] == 0 or rows.numel() == 0:
            return False
        return 2 * self._windows(name, rows).numel() < runs

    def _read_mapped(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` of field ``name`` gathered from the mapping, dropping the pages every
        ``MAPPED_WINDOWS`` windows (ascending rows: window numbers ascend, so a chunk is a row range)."""
        tensor = self.mapped[name]
        window = (self.regions[name][0] + rows * self._row_bytes[name]) // FAULT_AROUND_BYTES
        first = torch.unique_consecutive(window, return_counts=True)[1].cumsum(0)
        bounds = [0] + first[MAPPED_WINDOWS - 1 :: MAPPED_WINDOWS].tolist()
        if bounds[-1] != rows.numel():
            bounds.append(rows.numel())
        parts = []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            parts.append(tensor.index_select(0, rows[start:stop]))
            self.drop()
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def write_fields(self, rows: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        """Write ``values[name]`` (``[n, *width]`` of the field's dtype, host) to ``rows`` (ascending)."""
        runs = row_runs(rows)
        for name, tensor in values.items():
            self._write(name, tensor, runs)

    def read_into(
        self,
        rows: torch.Tensor,
        buffers: Mapping[str, torch.Tensor],
        slots: torch.Tensor,
        backend: Optional[str] = None,
    ) -> int:
        """Read file rows ``rows`` (int64 ``[n]``, host, any order, ascending is fastest) of every field
        into rows ``slots`` (int64 ``[n]``) of ``buffers[name]`` (``[C, *width]`` of the field's dtype,
        contiguous; on the host for the native path). ``backend``: ``"auto"`` (native when built, on the
        host and not switched off by :func:`~shardkit.kernels.kernel_backend`), ``"native"``, ``"torch"``;
        None: :attr:`backend` (``"auto"`` unless set, e.g. by a benchmark comparing the two paths).
        Returns the number of system calls: the native path makes one ``preadv`` per run of file bytes
        (adjacent rows x fields, runs at most :attr:`merge_gap` bytes apart merged); the pure-Python
        path one per run of adjacent rows and field."""
        return self._move(rows, buffers, slots, backend, write=False)

    def write_from(
        self,
        rows: torch.Tensor,
        buffers: Mapping[str, torch.Tensor],
        slots: torch.Tensor,
        backend: Optional[str] = None,
    ) -> int:
        """Write rows ``slots`` of ``buffers[name]`` to file rows ``rows`` of every field (the inverse of
        :meth:`read_into`, same arguments). Returns the number of system calls as :meth:`read_into`; a
        native write whose runs share a call through a gap counts two (the span's read and write).

        The native path's merged writes rewrite the gaps' bytes with what it just read: nothing else may
        write those bytes of the file meanwhile (the row cache's lock makes it the file's only writer
        while in use; state dicts and loads write the file after emptying it)."""
        return self._move(rows, buffers, slots, backend, write=True)

    def _native(self, buffers: Mapping[str, torch.Tensor], backend: str):
        if backend not in ("auto", "native", "torch"):
            raise ValueError(f"FileRowIO: unknown backend {backend!r}; expected 'auto', 'native' or 'torch'")
        native = None if backend == "torch" else native_for(torch.device("cpu"))
        ok = native is not None and hasattr(native, "file_read_rows")
        ok = ok and all(b.device.type == "cpu" and b.is_contiguous() for b in buffers.values())
        if backend == "native" and not ok:
            raise RuntimeError("FileRowIO: the native row I/O kernel is not available for these buffers")
        return native if ok else None

    def _move(self, rows, buffers, slots, backend: Optional[str], write: bool) -> int:
        backend = self.backend if backend is None else backend
        names = list(self.regions)
        if set(buffers) != set(names):
            raise ValueError(f"FileRowIO: buffers for fields {sorted(buffers)}, the file has {sorted(names)}")
        rows = rows.to(device="cpu", dtype=torch.int64).contiguous()
        slots = slots.to(device="cpu", dtype=torch.int64).contiguous()
        if rows.numel() != slots.numel():
            raise ValueError(f"FileRowIO: {rows.numel()} rows but {slots.numel()} slots")
        if rows.numel() == 0:
            return 0
        native = self._native(buffers, backend)
        if native is not None:
            op = native.file_write_rows if write else native.file_read_rows
            offsets = [self.regions[n][0] for n in names]
            strides = [self._row_bytes[n] for n in names]
            fields = [buffers[n] for n in names]
            try:
                if write:
                    return int(op(self.fd, rows, slots, fields, offsets, strides, self.merge_gap))
                threads = self.read_threads
                calls, self.last_read_threads = op(
                    self.fd, rows, slots, fields, offsets, strides, self.merge_gap, threads
                )
                return int(calls)
            except RuntimeError as e:
                raise OSError(f"backing file {self.path!r}: {e}".splitlines()[0]) from None
        # pure Python (today's read_fields / write_fields, dense reads through the mapping): fixed-size
        # pieces through a temporary, so the resident set stays bounded whatever the number of rows
        step = max(1, PIECE_BYTES // max(1, sum(self._row_bytes.values())))
        extents = 0
        for start in range(0, rows.numel(), step):
            part, where = rows[start : start + step], slots[start : start + step]
            if part.numel() > 1 and not bool((part[1:] > part[:-1]).all()):
                part, order = part.sort()
                where = where.index_select(0, order)
            extents += len(row_runs(part)[0]) * sum(1 for n in names if self._row_bytes[n])
            if write:
                self.write_fields(
                    part, {n: buffers[n].index_select(0, where.to(buffers[n].device)).cpu() for n in names}
                )
            else:
                for name, values in self.read_fields(part).items():
                    buffer = buffers[name]
                    buffer.index_copy_(0, where.to(buffer.device), values.to(buffer.device))
        return extents

    def _read(self, name: str, count: int, runs) -> torch.Tensor:
        _, shape, dtype = self.regions[name]
        row_bytes = self._row_bytes[name]
        if count == 0 or row_bytes == 0:
            return torch.empty((count, *shape[1:]), dtype=dtype)
        buffer = bytearray(count * row_bytes)
        self._transfer(os.preadv, name, buffer, runs, "read", "the file was truncated or damaged")
        return torch.frombuffer(buffer, dtype=dtype).view(count, *shape[1:])

    def _write(self, name: str, values: torch.Tensor, runs) -> None:
        _, shape, dtype = self.regions[name]
        row_bytes = self._row_bytes[name]
        count = values.size(0)
        if count == 0 or row_bytes == 0:
            return
        buffer = bytearray(count * row_bytes)
        torch.frombuffer(buffer, dtype=dtype).view(values.shape).copy_(values)
        self._transfer(os.pwritev, name, buffer, runs, "write", "is the disk full?")

    def _transfer(self, call, name: str, buffer: bytearray, runs, verb: str, hint: str) -> None:
        """One positioned ``call`` (``os.preadv`` / ``os.pwritev``) per run of field ``name``'s rows,
        between ``buffer`` (the runs' rows back to back) and the file; a short transfer is an OSError."""
        offset = self.regions[name][0]
        row_bytes = self._row_bytes[name]
        view = memoryview(buffer)
        for at, length, row in zip(*runs):
            want = length * row_bytes
            moved = call(self.fd, [view[at * row_bytes : at * row_bytes + want]], offset + row * row_bytes)
            if moved != want:
                raise OSError(
                    f"backing file {self.path!r}: short {verb} of field {name!r} "
                    f"rows {row}..{row + length - 1} ({moved} of {want} bytes): {hint}"
                )


__all__ = ["READ_THREADS_ENV", "FileRowIO", "advise_random", "read_threads_default", "row_runs"]
