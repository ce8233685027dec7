"""How a :class:`~shardkit.kernels.offload.row_cache.RowCache` moves rows between its slots and the backing
store (L0): misses read in, dirty victims written back (in the step or through the write-behind thread).

A mixin of ``RowCache`` (the attributes are the cache's: ``tensors``, ``backing``, ``device``,
``_row_io``, ``_write_behind``, ``_copies`` (a CUDA cache's side-stream copies, ``device_copies.py``),
``io_chunk_rows``, ``_after_io``, ``counters``, ``row_bytes``, ``_direct_fields``: fields the
``row_io`` does not cover, moved by index ops on their backing tensors); every method runs under the
cache's lock. Rows move in ascending row order (sequential access of the file).
"""

from __future__ import annotations

from typing import List, Tuple

import torch


class RowMoves:
    """Reads and write-backs of a row cache (see the module docstring)."""

    def _write_back(self, rows: torch.Tensor, slots: torch.Tensor, ordered: bool = False) -> None:
        """Copy slots ``slots`` to backing rows ``rows`` (int64 [n] each, host), in ascending row order
        (``ordered``: ``rows`` already ascend)."""
        count = rows.numel()
        if self._write_behind is not None:  # one writer of the file at a time, in eviction order
            self._write_behind.wait()
        if not count:
            return
        if not ordered:
            rows, order = rows.sort()
            slots = slots[order]
        if self._copies is not None:  # a CUDA cache: on the copy stream, landed later (device_copies.py)
            self._copies.write(self.tensors, rows, slots)
            self.counters.rows_written += count
            self.counters.bytes_written += count * self.row_bytes
            return
        for start, stop in self._io_chunks(count):
            cache_slots = slots[start:stop].to(self.device)
            if self._row_io is not None:
                self._row_io.write_from(rows[start:stop], self._io_buffers(), cache_slots)
                self._write_direct(rows[start:stop], cache_slots)
                continue
            for name, store in self.backing.items():
                values = self.tensors[name].index_select(0, cache_slots).to(store.device)
                store.index_copy_(0, rows[start:stop].to(store.device), values)
            if self._after_io is not None:
                self._after_io()
        self.counters.rows_written += count
        self.counters.bytes_written += count * self.row_bytes

    def _stage_write_back(self, rows: torch.Tensor, slots: torch.Tensor, ordered: bool = False) -> None:
        """:meth:`_write_back` through the write-behind thread: the slots' rows copied out (the slots are
        free for reuse at once), then written in the background, in ascending row order."""
        count = rows.numel()
        if not count:
            return
        if not ordered:
            rows, order = rows.sort()
            slots = slots.index_select(0, order)
        # fields outside the row_io (kept mapped) are written now: a copy, and never read from the file
        self._write_direct(rows, slots)
        staging = {name: buffer.index_select(0, slots) for name, buffer in self._io_buffers().items()}
        self._write_behind.submit(rows, staging)
        self.counters.rows_written += count
        self.counters.bytes_written += count * self.row_bytes

    def _read_rows(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy backing rows ``rows`` (ascending int64 [n], host) into slots ``slots`` (int64 [n]): the
        data only, not the bookkeeping (``RowCache._load``)."""
        if self._write_behind is not None:  # a row evicted and asked again: its write lands first
            self._write_behind.wait_for(rows)
        if self._copies is not None:  # a CUDA cache: on the copy stream (device_copies.py)
            self._copies.read(self.tensors, rows, slots)
        else:
            self._read_chunks(rows, slots)
        count = rows.numel()
        self.counters.rows_read += count
        self.counters.bytes_read += count * self.row_bytes

    def _read_chunks(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        for start, stop in self._io_chunks(rows.numel()):
            cache_slots = slots[start:stop].to(self.device)
            if self._row_io is not None:
                self._row_io.read_into(rows[start:stop], self._io_buffers(), cache_slots)
                for name in self._direct_fields:
                    values = self.backing[name].index_select(0, rows[start:stop])
                    self.tensors[name].index_copy_(0, cache_slots, values)
                continue
            for name, store in self.backing.items():
                values = store.index_select(0, rows[start:stop].to(store.device)).to(self.device)
                self.tensors[name].index_copy_(0, cache_slots, values)
            if self._after_io is not None:
                self._after_io()

    def _io_buffers(self):
        """The cache buffers of the fields the ``row_io`` moves (all, unless some are direct)."""
        if not self._direct_fields:
            return self.tensors
        return {name: t for name, t in self.tensors.items() if name not in self._direct_fields}

    def _write_direct(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Slots ``slots``' values of the direct fields (those the ``row_io`` does not move) copied to
        their backing tensors' rows ``rows``."""
        for name in self._direct_fields:
            self.backing[name].index_copy_(0, rows, self.tensors[name].index_select(0, slots))

    def _io_chunks(self, count: int) -> List[Tuple[int, int]]:
        """``(start, stop)`` ranges covering ``[0, count)``, ``io_chunk_rows`` long (one range if None)."""
        step = self.io_chunk_rows or max(count, 1)
        return [(start, min(start + step, count)) for start in range(0, count, step)]


__all__ = ["RowMoves"]
