"""Write-back of a row cache's evicted dirty rows on a background thread (off the step's critical path).

A training step's misses evict dirty rows (every row a step touched is dirty), and each must reach the
backing file before its slot is reused: one ``pwritev`` per row and field, about as much CPU as the
miss's own read (docs/offload/miss_path.md). :class:`WriteBehind` takes those rows as a *copy* (a
staging tensor per field, so that the slots can be reused at once) and writes them with the cache's
``row_io`` on a thread of its own; the system calls release the GIL, so with a core free (a rank running
``torch.set_num_threads(1)`` on a two-core machine, or a spare core per rank) the writes overlap the
step. It reduces the step's wall time, not the process's CPU time.

Ordering (what keeps results exact): a row whose write is still pending is read again only after that
write is done (:meth:`WriteBehind.wait_for`, called by the cache before it reads misses); the cache's
other writes to the file (:meth:`RowCache.flush`) wait for every pending write first
(:meth:`WriteBehind.wait`), so the file has one writer at a time and the rows reach it in eviction
order. Memory: at most ``limit_bytes`` of staged rows (a submit beyond it waits for the writes).
Errors: an exception of a write (a full disk, ...) is kept and raised by the next :meth:`submit`,
:meth:`wait_for` or :meth:`wait` (the cache's next acquire or flush); the writes queued after it are
not attempted.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Deque, Dict, Optional, Tuple

import torch

# staged rows at most (bytes) before a submit waits for the writer: bounds the resident set
LIMIT_BYTES = 16 << 20
# "0" / "off": offloaded lookups write their evicted rows back in the step, as before
WRITE_BEHIND_ENV = "SHARDKIT_OFFLOAD_WRITE_BEHIND"


def write_behind_default() -> bool:
    """Whether offloaded lookups on CPU write evicted dirty rows on a background thread
    (``$SHARDKIT_OFFLOAD_WRITE_BEHIND``: on unless ``0`` / ``off`` / ``false``)."""
    return os.environ.get(WRITE_BEHIND_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


_Job = Tuple[torch.Tensor, Dict[str, torch.Tensor], int]


def _holds_any(ascending: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether any of ``rows`` (int64, host) is in ``ascending`` (int64 ``[n]``, strictly ascending: a
    job's rows). A binary search of each row: ~20x cheaper than ``torch.isin`` for a step's misses
    against a step's write-backs (thousands each), and this runs before every miss read."""
    if not ascending.numel() or not rows.numel():
        return False
    where = torch.searchsorted(ascending, rows).clamp_(max=ascending.numel() - 1)
    return bool((ascending.index_select(0, where) == rows).any())


class WriteBehind:
    """Background writer of staged rows through ``row_io.write_from`` (a
    :class:`~shardkit.kernels.offload.row_io.FileRowIO`, or anything with that method).

    Args:
        row_io: writes ``write_from(rows, buffers, slots)``.
        limit_bytes: most bytes of staged rows held at once.
        keepalive: an object kept alive while writes are pending (the backing store, whose descriptor
            ``row_io`` writes to: it must not be closed under a pending write).
    """

    def __init__(self, row_io: Any, limit_bytes: int = LIMIT_BYTES, keepalive: Any = None) -> None:
        self._row_io = row_io
        self._keepalive = keepalive
        self.limit_bytes = limit_bytes
        self._cond = threading.Condition()
        self._jobs: Deque[_Job] = collections.deque()
        self._in_flight: Optional[_Job] = None
        self._pending_bytes = 0
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self.rows_written = 0  # rows the thread wrote (tests)

    def submit(self, rows: torch.Tensor, staging: Dict[str, torch.Tensor]) -> None:
        """Queue ``staging[name][i]`` (``[n, *width]`` per field, host, contiguous; owned by the writer
        from now on) for file row ``rows[i]`` (int64 ``[n]``, host, ascending, distinct)."""
        count = rows.numel()
        if not count:
            return
        if count > 1 and not bool((rows[1:] > rows[:-1]).all()):
            raise ValueError("WriteBehind.submit: rows must be distinct and ascending (wait_for searches)")
        nbytes = sum(t.numel() * t.element_size() for t in staging.values())
        with self._cond:
            self._raise_error()
            while self._pending_bytes and self._pending_bytes + nbytes > self.limit_bytes:
                self._cond.wait()
                self._raise_error()
            self._jobs.append((rows, staging, nbytes))
            self._pending_bytes += nbytes
            if self._thread is None:  # the thread exits when the queue runs empty: none idles
                self._thread = threading.Thread(target=self._run, name="shardkit-write-behind", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait_for(self, rows: torch.Tensor) -> None:
        """Return once no write of any of ``rows`` (int64, host) is pending (waits for every pending
        write if one of them holds such a row); raises a write's kept exception."""
        with self._cond:
            self._raise_error()
            jobs = list(self._jobs) + ([self._in_flight] if self._in_flight is not None else [])
        if any(_holds_any(job[0], rows) for job in jobs):
            self.wait()

    def wait(self) -> None:
        """Return once every queued write is done; raises a write's kept exception."""
        with self._cond:
            while self._jobs or self._in_flight is not None:
                self._cond.wait()
            self._raise_error()

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._pending_bytes

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._in_flight = self._jobs.popleft()
                skip = self._error is not None
            rows, staging, nbytes = job
            try:
                if not skip:
                    self._row_io.write_from(rows, staging, torch.arange(rows.numel()))
                    self.rows_written += rows.numel()
            except BaseException as e:  # kept for the cache's next call
                with self._cond:
                    if self._error is None:
                        self._error = e
            finally:
                with self._cond:
                    self._in_flight = None
                    self._pending_bytes -= nbytes
                    self._cond.notify_all()


__all__ = ["LIMIT_BYTES", "WRITE_BEHIND_ENV", "WriteBehind", "write_behind_default"]
