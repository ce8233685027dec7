"""A :class:`~shardkit.kernels.offload.row_cache.RowCache`'s slot bookkeeping, one batch's steps (L0).

A mixin of ``RowCache`` (its attributes: the slot map ``_slot_map`` (``slot_map.py``: dense or hashed;
the native ops take its ``tensors``), ``row_of_slot``, ``_pins``,
``_dirty``, ``_stamp``, ``_freq``, ``_clock``, the replacement queue, the counters); every method runs
under the cache's lock. Each step has two paths with the same results: the native ops
(``csrc/row_cache.cpp``, ``csrc/row_cache_queue.cpp``: one C++ loop each) where the native kernels are
built and enabled, else vectorized torch ops (``SHARDKIT_NATIVE=0``, ``kernel_backend("torch")``,
``RowCache.use_native = False``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from shardkit.kernels.embedding import native_for
from shardkit.kernels.offload.slot_queue import NativeSlotQueue, TorchLruQueue
from shardkit.kernels.offload.victims import select_victims


def ones_int32(count: int, value: int = 1, device: Optional[torch.device] = None) -> torch.Tensor:
    """``[count]`` int32 filled with ``value`` (pin count increments), on ``device`` (default CPU)."""
    return torch.full((count,), value, dtype=torch.int32, device=device)


class CacheSlots:
    """The per-batch bookkeeping of a row cache (see the module docstring)."""

    def _lookup(self, rows: torch.Tensor, native: Optional[Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(looked, miss_rows)``: the slot of each of ``rows`` (int64, -1 = miss) and the missing rows in
        the order of ``rows``; the hits are pinned (first: never victims of this acquire)."""
        if native is not None:  # one pass
            return native.row_cache_lookup(self._slot_map.tensors, self.num_rows, self._pins, rows)
        # index_select / index_add_ / index_copy_ rather than advanced indexing: the same values (the
        # slots are distinct), several times faster on CPU, and no parallel section that a loaded
        # machine stretches to a scheduler time slice
        looked = self._slot_map.get(rows)
        hit = looked >= 0
        hit_slots = looked[hit]
        self._pins.index_add_(0, hit_slots, ones_int32(hit_slots.numel()))
        return looked, rows[~hit]

    def _commit(
        self, rows: torch.Tensor, looked: torch.Tensor, miss_rows: torch.Tensor, native: Optional[Any]
    ) -> torch.Tensor:
        """The slots of ``rows`` (all resident now), stamped ``clock``, ``clock + 1``, ... in the order of
        ``rows``, their acquisition counts + 1 (the caller advances the clock)."""
        if native is not None:  # one pass
            book = self._slot_map.tensors
            return native.row_cache_commit(book, self.num_rows, rows, self._stamp, self._freq, self._clock)
        count = rows.numel()
        slots = self._slot_map.get(rows) if miss_rows.numel() else looked
        self._stamp.index_copy_(0, slots, self._clock + torch.arange(count, dtype=torch.int64))
        self._freq.index_add_(0, slots, torch.ones(count, dtype=torch.int64))
        return slots

    def _unpin(self, slots: torch.Tensor, dirty: bool) -> None:
        """A released ticket's ``slots`` unpinned once, marked dirty if its kernel updated them."""
        native = self._native()
        if native is not None:  # one pass
            native.row_cache_release(slots, self._pins, self._dirty, dirty)
            return
        if dirty:
            self._dirty.index_fill_(0, slots, True)
        if self.bookkeeping == "device":  # the reused ones (device_slots.py): no fill queued a release
            self._scratch(slots.numel())
            self._pins.index_add_(0, slots, self._ones32[: slots.numel()], alpha=-1)
            return
        self._pins.index_add_(0, slots, ones_int32(slots.numel(), -1, slots.device))

    def _native(self) -> Optional[Any]:
        """The native bookkeeping ops (``torch.ops.shardkit_native``), or None: the pure-torch path (not
        built, ``SHARDKIT_NATIVE=0``, or ``kernel_backend("torch")``; the bookkeeping is on the host). The
        device bookkeeping (``device_slots.py``) runs the torch ops on its device in its rare paths."""
        if not self.use_native or self.bookkeeping == "device":
            return None
        return native_for(torch.device("cpu"))

    def _sync_queue(self, native: Optional[Any]) -> None:
        """The replacement queue of this path (native: ``NativeSlotQueue``, LRU or LFU; torch: a
        ``TorchLruQueue`` for LRU, none for LFU, which selects over the cache), rebuilt from the stamps
        when the path changed since the last acquire (``use_native``, ``kernel_backend``)."""
        kind = "native" if native is not None else ("torch" if self.algorithm == "lru" else None)
        if kind == self._queue_kind:
            return
        if kind == "native":
            self._queue = NativeSlotQueue(self.algorithm == "lfu")
        else:
            self._queue = TorchLruQueue() if kind == "torch" else None
        self._queue_kind = kind
        if self._queue is not None:
            self._rebuild_queue()

    def _rebuild_queue(self) -> None:
        """The replacement queue from the stamps: one entry per resident slot, in eviction order."""
        self._queue.rebuild(self.row_of_slot, self._stamp, self._freq)

    def _free_slots(self, count: int) -> torch.Tensor:
        """``count`` free slots (int64, host, ascending), evicting unpinned rows or growing the buffers."""
        if self._resident >= self.size:  # a full cache (the steady state): no scan of the slot map
            free = torch.zeros(0, dtype=torch.int64)
        else:
            free = (self.row_of_slot < 0).nonzero().flatten()
        if free.numel() >= count:
            return free[:count]
        needed = count - free.numel()
        # the common case: the victims from the front of the replacement queue, no scan or selection
        # over the whole cache, not even a count of the evictable slots (None: the queue ran out)
        victims = self._queue.take(needed, self._stamp, self._pins) if self._queue is not None else None
        if victims is None:
            evictable = ((self.row_of_slot >= 0) & (self._pins == 0)).nonzero().flatten()
            if evictable.numel() < needed:
                # the pinned working set exceeds the capacity: grow so the whole request fits (every
                # evictable slot goes: the entries a failed take removed were all theirs)
                self._grow(self.size + needed - evictable.numel())
                self._evict(evictable)
                return (self.row_of_slot < 0).nonzero().flatten()[:count]
            victims = self._victims(evictable, needed)  # the queue's choice, had it been whole
            self._evict(victims)
            if self._queue is not None:
                self._rebuild_queue()  # the failed take removed entries of slots that stay
            return torch.cat([free, victims]).sort().values
        self._evict(victims)
        # the free slots now are exactly the old free ones and the victims (count of them): no second
        # scan of the slot map, the same ascending slots (the native queue's victims already ascend)
        if free.numel():
            return torch.cat([free, victims]).sort().values
        return victims if self._queue_kind == "native" else victims.sort().values

    def _victims(self, candidates: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` slots among ``candidates`` (int64 [n]) to evict first under the algorithm (a set:
        callers do not depend on its order; the native op returns it ascending). Slots tied on the
        stamp (only rows left unstamped by a failed acquire) are chosen by the smaller slot natively."""
        if count >= candidates.numel():
            return candidates
        if count == 0:
            return candidates[:0]
        lfu = self.algorithm == "lfu"
        native = self._native()
        if native is not None:  # one selection over (freq, stamp) keys: the same slots, ascending
            return native.row_cache_victims(candidates, self._stamp, self._freq, count, lfu)
        return select_victims(candidates, self._stamp, self._freq, count, lfu)

    def _evict(self, victims: torch.Tensor) -> None:
        """Drop the rows in slots ``victims`` (int64 [n]), writing the dirty ones back first."""
        if not victims.numel():
            return
        native = self._native()
        if native is not None:
            # one pass each: the dirty victims' rows and slots (ascending rows), then, once written, the
            # rows forgotten (slot map, dirty flags, stamps, counts)
            rows, slots = native.row_cache_victim_rows(victims, self.row_of_slot, self._dirty)
            if self._write_behind is not None:
                self._stage_write_back(rows, slots, ordered=True)
            else:
                self._write_back(rows, slots, ordered=True)
            book = (self.row_of_slot, self._dirty, self._stamp, self._freq)
            native.row_cache_drop(victims, self._slot_map.tensors, self.num_rows, *book)
        else:
            rows = self.row_of_slot[victims]
            dirty = self._dirty[victims]
            if self._write_behind is not None:
                self._stage_write_back(rows[dirty], victims[dirty])
            else:
                self._write_back(rows[dirty], victims[dirty])
            # index_fill_ rather than indexed assignment: the same values, no index_put_ machinery
            self._slot_map.erase(rows)
            self.row_of_slot.index_fill_(0, victims, -1)
            self._dirty.index_fill_(0, victims, False)
            self._stamp.index_fill_(0, victims, 0)
            self._freq.index_fill_(0, victims, 0)
        self._resident -= victims.numel()
        self.counters.evictions += victims.numel()

    def _load(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Read backing rows ``rows`` (ascending int64 [n], host) into free slots ``slots`` (int64 [n])
        and make them resident, clean, unstamped and pinned once (by the acquire that loads them)."""
        self._read_rows(rows, slots)
        native = self._native()
        if native is not None:
            state = (self.row_of_slot, self._dirty, self._stamp, self._freq, self._pins)
            native.row_cache_install(rows, slots, self._slot_map.tensors, self.num_rows, *state, 1)
        else:
            # index_copy_ / index_fill_ rather than indexed assignment: the same values, cheaper
            self._slot_map.put(rows, slots)
            self.row_of_slot.index_copy_(0, slots, rows)
            self._dirty.index_fill_(0, slots, False)
            self._stamp.index_fill_(0, slots, 0)
            self._freq.index_fill_(0, slots, 0)
            self._pins.index_add_(0, slots, ones_int32(slots.numel()))
        self._resident += rows.numel()


__all__ = ["CacheSlots", "ones_int32"]
