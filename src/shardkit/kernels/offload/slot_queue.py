"""The row cache's replacement queues (L0): an eviction's victims taken from the front of a queue, without
a selection over every slot of the cache.

A :class:`~shardkit.kernels.offload.row_cache.RowCache` evicts the unpinned resident slots with the smallest
key: LRU, the last-acquire stamp; LFU, (acquisitions since loaded, stamp). Both queues here return exactly
those slots (the choice of :func:`~shardkit.kernels.offload.victims.select_victims` over all of them),
or None when they run out (fewer evictable slots than asked, or a resident slot without an entry); the
cache then selects over the whole cache and rebuilds the queue.

- :class:`TorchLruQueue`: the pure-torch path's LRU queue (a list of an acquire's slots and stamps).
- :class:`NativeSlotQueue`: ``torch.classes.shardkit_native.SlotQueue`` (``csrc/row_cache_queue.cpp``),
  LRU and LFU (per-count buckets, each in stamp order), one C++ loop per take.

An entry is *current* while its slot still has the entry's stamp (stamps never repeat; loading and
eviction reset a slot's stamp to 0), so a slot acquired again leaves its older entries stale; stale
entries are dropped when they reach the front. Every method is called under the cache's lock.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


class TorchLruQueue:
    """LRU on the torch path: ``(slots, stamps)`` of every acquire, in stamp order."""

    def __init__(self) -> None:
        self._chunks: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.entries = 0

    def push(self, slots: torch.Tensor, clock: int, freq: torch.Tensor) -> None:
        """Append ``slots`` (int64 [n], host), stamped ``clock``, ``clock + 1``, ... (``freq`` unused)."""
        self._chunks.append((slots, clock + torch.arange(slots.numel(), dtype=torch.int64)))
        self.entries += slots.numel()

    def take(self, count: int, stamp: torch.Tensor, pins: torch.Tensor) -> Optional[torch.Tensor]:
        """The ``count`` least recently acquired unpinned resident slots (int64, any order), removed from
        the queue, or None if it ran out first (it then lost what it took: the caller rebuilds it).
        Current pinned entries stay, in their place."""
        taken: List[torch.Tensor] = []
        got, index = 0, 0
        while got < count:
            if index >= len(self._chunks):
                return None
            slots, stamps = self._chunks[index]
            current = stamp.index_select(0, slots) == stamps
            free_to_take = current & (pins.index_select(0, slots) == 0)
            positions = free_to_take.nonzero().flatten()[: count - got]
            taken.append(slots.index_select(0, positions))
            got += positions.numel()
            current.index_fill_(0, positions, False)  # what stays: current entries not taken
            kept = current.nonzero().flatten()
            self.entries -= slots.numel() - kept.numel()
            if kept.numel():
                self._chunks[index] = (slots.index_select(0, kept), stamps.index_select(0, kept))
                index += 1
            else:
                del self._chunks[index]
        return torch.cat(taken) if len(taken) > 1 else taken[0]

    def rebuild(self, row_of_slot: torch.Tensor, stamp: torch.Tensor, freq: torch.Tensor) -> None:
        """One entry per resident slot (``row_of_slot >= 0``), in stamp order."""
        resident = (row_of_slot >= 0).nonzero().flatten()
        stamps, order = stamp.index_select(0, resident).sort(stable=True)
        self._chunks = [(resident.index_select(0, order), stamps)] if resident.numel() else []
        self.entries = resident.numel()

    def clear(self) -> None:
        self._chunks, self.entries = [], 0


class NativeSlotQueue:
    """LRU (``lfu`` False) or LFU over the native ``SlotQueue``; the same interface as
    :class:`TorchLruQueue`."""

    def __init__(self, lfu: bool) -> None:
        self._queue = torch.classes.shardkit_native.SlotQueue(lfu)

    @property
    def entries(self) -> int:
        return int(self._queue.entries())

    def push(self, slots: torch.Tensor, clock: int, freq: torch.Tensor) -> None:
        """Append ``slots`` (int64 [n], host), stamped ``clock``, ``clock + 1``, ..., each to the bucket
        of its count ``freq[slot]`` (after this acquire; LFU)."""
        self._queue.push(slots, freq, clock)

    def take(self, count: int, stamp: torch.Tensor, pins: torch.Tensor) -> Optional[torch.Tensor]:
        """The ``count`` victims (int64, ascending), or None if the queue ran out (see TorchLruQueue)."""
        victims = self._queue.take(count, stamp, pins)
        return victims if victims.numel() == count else None

    def rebuild(self, row_of_slot: torch.Tensor, stamp: torch.Tensor, freq: torch.Tensor) -> None:
        """One entry per resident slot, in (count, stamp, slot) order (LRU: (stamp, slot))."""
        self._queue.rebuild(row_of_slot, stamp, freq)

    def clear(self) -> None:
        self._queue.clear()


__all__ = ["NativeSlotQueue", "TorchLruQueue"]
