"""Growing and shrinking a :class:`~shardkit.kernels.offload.row_cache.RowCache`'s buffers (L0).

A mixin of ``RowCache``: when the pinned working set exceeds the capacity the buffers grow (reallocated,
old slots keep their rows); once nothing is pinned they shrink back to ``capacity`` (the excess evicted by
the replacement algorithm, the kept slots compacted to the front, the replacement queue rebuilt).
Both hold the cache's buffers lock, so that a kernel updating pinned rows in place finishes first.
"""

from __future__ import annotations

import torch


class CacheResize:
    """Reallocation of a row cache's buffers (see the module docstring)."""

    def _grow(self, size: int) -> None:
        """Reallocate every buffer with ``size`` slots; the existing slots keep their rows and state."""
        if size >= 2**31:
            raise RuntimeError(f"RowCache: {size} slots do not fit the int32 slot map")
        with self._buffers_lock:  # a kernel updating pinned rows in place finishes first
            self._grow_buffers(size)

    def _grow_buffers(self, size: int) -> None:
        if self._copies is not None:  # the copies into the old buffers land before they are copied
            self._copies.fence()
        old = self.size
        extra = size - old
        for name, buffer in self.tensors.items():
            grown = torch.zeros((size, *buffer.shape[1:]), dtype=buffer.dtype, device=self.device)
            grown[:old] = buffer
            self.tensors[name] = grown
        book = self.row_of_slot.device  # the host, or the cache's device (device_slots.py)
        free = torch.full((extra,), -1, dtype=torch.int64, device=book)
        self.row_of_slot = torch.cat([self.row_of_slot, free])
        self._dirty = torch.cat([self._dirty, torch.zeros(extra, dtype=torch.bool, device=book)])
        self._pins = torch.cat([self._pins, torch.zeros(extra, dtype=torch.int32, device=book)])
        self._stamp = torch.cat([self._stamp, torch.zeros(extra, dtype=torch.int64, device=book)])
        self._freq = torch.cat([self._freq, torch.zeros(extra, dtype=torch.int64, device=book)])
        if self._slot_map.kind == "hash":  # sized for the slots (load <= 0.5); the dense map stays as it is
            self._slot_map.refill(self.row_of_slot)
        self.buffers_version += 1

    def _shrink(self) -> None:
        """Back to ``capacity`` slots (no ticket pinned): evict the excess by the algorithm, then compact."""
        with self._buffers_lock:
            self._shrink_buffers()

    def _shrink_buffers(self) -> None:
        resident = (self.row_of_slot >= 0).nonzero().flatten()
        self._evict(self._victims(resident, max(resident.numel() - self.capacity, 0)))
        if self._copies is not None:  # the write-backs read the old buffers before they are freed
            self._copies.fence()
        kept = (self.row_of_slot >= 0).nonzero().flatten()  # ascending slots, at most capacity of them
        count = kept.numel()
        cache_kept = kept.to(self.device)
        for name, buffer in self.tensors.items():
            shrunk = torch.zeros((self.capacity, *buffer.shape[1:]), dtype=buffer.dtype, device=self.device)
            shrunk[:count] = buffer.index_select(0, cache_kept)
            self.tensors[name] = shrunk

        book = self.row_of_slot.device

        def compact(values: torch.Tensor, fill: int) -> torch.Tensor:
            out = torch.full((self.capacity,), fill, dtype=values.dtype, device=book)
            out[:count] = values[kept]
            return out

        self.row_of_slot = compact(self.row_of_slot, -1)
        self._resident = count
        self._dirty = compact(self._dirty, 0)
        self._stamp = compact(self._stamp, 0)
        self._freq = compact(self._freq, 0)
        self._pins = torch.zeros(self.capacity, dtype=torch.int32, device=book)
        self._slot_map.refill(self.row_of_slot)  # the kept rows' new slots (hashed: sized for capacity)
        self.buffers_version += 1
        if self._queue is not None:  # the slots moved
            self._rebuild_queue()


__all__ = ["CacheResize"]
