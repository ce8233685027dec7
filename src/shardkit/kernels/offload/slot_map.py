"""A row cache's slot map, row -> slot (L0): dense (4 bytes a table row) or hashed (O(cache slots)).

A :class:`~shardkit.kernels.offload.row_cache.RowCache` maps each cached row of its table (``R`` rows) to
its slot (``C`` slots). Two layouts, the same answers (tests/kernels/offload/test_slot_map.py):

- :class:`DenseSlotMap`: ``slot_of_row`` int32 ``[R]``, -1 for a row not cached: one read a lookup, but
  ``4 R`` bytes whatever the cache, which outgrows a memory budget once the table is large against it
  (a table 100x a 64 MiB budget of dim-8 rows: 750 MB of map).
- :class:`HashSlotMap`: open addressing, ``keys`` int64 ``[H]`` (-1 = empty) and ``slots`` int32 ``[H]``,
  ``H`` a power of two >= ``2 C`` (load <= 0.5), linear probing from the row's home
  ``(row * 0x9E3779B97F4A7C15 mod 2^64) >> (64 - log2 H)``, deletion without tombstones: ``12 H`` bytes,
  24 to 48 a slot, whatever ``R``. Resized with the cache (``RowCache`` growth and shrinking).

Both are read and written by the native ops (``csrc/slot_map.h``, through :attr:`tensors`) and by the
methods here (the pure-torch path: the hashed map by vectorized probing rounds, one round a probe step
of every pending row). Which one a cache gets: :func:`choose_slot_map`.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple, Union

import torch

# "dense" / "hash": that map for every host-bookkept cache; "auto" / unset: choose_slot_map's rule
SLOT_MAP_ENV = "SHARDKIT_OFFLOAD_SLOT_MAP"
SLOT_MAP_KINDS = ("dense", "hash")
# the dense map is kept while its 4 bytes a table row are at most this share of the cache's buffers
DENSE_SHARE = 1 / 32
# 0x9E3779B97F4A7C15 (2^64 / golden ratio) as an int64: Fibonacci hashing, the native ops' multiplier
HASH_MULTIPLIER = 0x9E3779B97F4A7C15 - 2**64
MIN_HASH_ENTRIES = 16
# bytes a slot of the cache that its per-slot bookkeeping costs besides the map: row_of_slot, stamp and
# frequency (int64 each), pin count (int32), dirty flag
SLOT_BOOKKEEPING_BYTES = 8 + 8 + 8 + 4 + 1
# the hashed map's bytes a slot, at most (H < 4 C entries of 12 bytes): the planner's estimate
HASH_BYTES_PER_SLOT = 48


def hash_entries(size: int) -> int:
    """Entries of the hashed map of a cache of ``size`` slots: the power of two >= ``2 size`` (>= 16)."""
    entries = MIN_HASH_ENTRIES
    while entries < 2 * size:
        entries *= 2
    return entries


def choose_slot_map(
    requested: Optional[str], num_rows: int, capacity: int, row_bytes: int, device_bookkeeping: bool = False
) -> Tuple[str, str]:
    """``(kind, reason)``: ``"dense"`` or ``"hash"`` for a cache of ``capacity`` rows of ``row_bytes`` bytes
    over a table of ``num_rows`` rows, and why.

    ``requested`` (``RowCache(slot_map=...)``) wins, then ``$SHARDKIT_OFFLOAD_SLOT_MAP`` (``dense`` /
    ``hash`` / ``auto``); else the rule: dense while ``4 R <= max(12 H, DENSE_SHARE x C x row_bytes)``
    (no larger than the hashed map, or at most 1/32 of the cache's buffers), else hashed. The device
    bookkeeping of a CUDA cache (``device_slots.py``) keeps the dense map on its device.
    ValueError for an unknown kind, naming where it came from.
    """
    if device_bookkeeping:
        if requested not in (None, "dense"):
            raise ValueError(f"RowCache: slot_map={requested!r}: the device bookkeeping keeps a dense map")
        return "dense", "the device bookkeeping (device_slots.py) keeps the dense map"
    if requested is not None:
        if requested not in SLOT_MAP_KINDS:
            raise ValueError(f"RowCache: slot_map={requested!r}; expected one of {SLOT_MAP_KINDS} or None")
        return requested, f"slot_map={requested!r}"
    value = os.environ.get(SLOT_MAP_ENV, "").strip().lower()
    if value in SLOT_MAP_KINDS:
        return value, f"${SLOT_MAP_ENV}={value}"
    if value not in ("", "auto"):
        raise ValueError(f"${SLOT_MAP_ENV}={value!r}: expected dense, hash or auto")
    dense_bytes = 4 * num_rows
    hash_bytes = 12 * hash_entries(capacity)
    cache_bytes = capacity * row_bytes
    kind = "dense" if dense_bytes <= max(hash_bytes, DENSE_SHARE * cache_bytes) else "hash"
    return kind, (
        f"auto: dense map {dense_bytes} B, hashed {hash_bytes} B, cache buffers {cache_bytes} B "
        f"(dense while at most the hashed map or 1/32 of the buffers)"
    )


class DenseSlotMap:
    """``slot_of_row`` int32 ``[R]`` on ``device`` (-1: not cached)."""

    kind = "dense"

    def __init__(self, num_rows: int, device: torch.device, padded: bool = False) -> None:
        # padded (the device bookkeeping, device_slots.py): one extra entry R = -2 after the map, where
        # that path looks its padding up (neither a hit nor a miss); ``map`` is the [R] view of it
        self.padded = torch.full((num_rows + int(padded),), -1, dtype=torch.int32, device=device)
        if padded:
            self.padded[num_rows] = -2
        self.map = self.padded[:num_rows]

    @property
    def tensors(self) -> List[torch.Tensor]:
        """What the native ops take (``csrc/slot_map.h``)."""
        return [self.map]

    @property
    def nbytes(self) -> int:
        return self.map.numel() * 4

    def dense(self) -> torch.Tensor:
        """The map as int32 ``[R]``: the map itself (writes through)."""
        return self.map

    def get(self, rows: torch.Tensor) -> torch.Tensor:
        """The slot of each of ``rows`` (int64 ``[n]``): int64 ``[n]``, -1 for a row not cached."""
        return self.map.index_select(0, rows).long()

    def put(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows ``rows`` (distinct, int64 ``[n]``, not in the map) -> ``slots`` (int64 ``[n]``)."""
        self.map.index_copy_(0, rows, slots.to(torch.int32))

    def erase(self, rows: torch.Tensor) -> None:
        """Rows ``rows`` (in the map) forgotten."""
        self.map.index_fill_(0, rows, -1)

    def clear(self, row_of_slot: torch.Tensor) -> None:
        """Every row forgotten (``row_of_slot``: the cache's rows, -1 for a free slot)."""
        self.map.index_fill_(0, row_of_slot[row_of_slot >= 0], -1)

    def refill(self, row_of_slot: torch.Tensor) -> None:
        """The map of the rows in ``row_of_slot`` (the slots moved or their number changed; the map held
        exactly those rows before)."""
        resident = (row_of_slot >= 0).nonzero().flatten()
        self.map.index_copy_(0, row_of_slot.index_select(0, resident), resident.to(torch.int32))


class HashSlotMap:
    """The hashed map (see the module docstring): ``keys`` int64 ``[H]``, ``slots`` int32 ``[H]``, host."""

    kind = "hash"

    def __init__(self, num_rows: int, size: int) -> None:
        self.num_rows = num_rows
        self._allocate(hash_entries(size))

    def _allocate(self, entries: int) -> None:
        self.keys = torch.full((entries,), -1, dtype=torch.int64)
        self.slots = torch.full((entries,), -1, dtype=torch.int32)
        self._mask = entries - 1
        self._shift = 64 - (entries.bit_length() - 1)

    @property
    def tensors(self) -> List[torch.Tensor]:
        return [self.keys, self.slots]

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * 12

    def _home(self, rows: torch.Tensor) -> torch.Tensor:
        # int64 products wrap mod 2^64; the arithmetic shift's low log2(H) bits are the logical shift's
        return ((rows * HASH_MULTIPLIER) >> self._shift) & self._mask

    def _positions(self, rows: torch.Tensor) -> torch.Tensor:
        """The entry of each of ``rows`` (int64 ``[n]``), -1 for a row not in the map."""
        out = torch.full((rows.numel(),), -1, dtype=torch.int64)
        pending = torch.arange(rows.numel())
        pos = self._home(rows)
        while pending.numel():  # one probe step of every row still looking
            keys = self.keys.index_select(0, pos)
            found = keys == rows
            # one nonzero each, then index_select: cheaper than a boolean mask per tensor
            hit = found.nonzero().flatten()
            if hit.numel():
                out.index_copy_(0, pending.index_select(0, hit), pos.index_select(0, hit))
            going = ((keys >= 0) & ~found).nonzero().flatten()
            pending, rows = pending.index_select(0, going), rows.index_select(0, going)
            pos = (pos.index_select(0, going) + 1) & self._mask
        return out

    def dense(self) -> torch.Tensor:
        """The map as int32 ``[R]``: a copy (``R`` entries: for inspection and tests)."""
        out = torch.full((self.num_rows,), -1, dtype=torch.int32)
        used = self.keys >= 0
        out.index_copy_(0, self.keys[used], self.slots[used])
        return out

    def get(self, rows: torch.Tensor) -> torch.Tensor:
        pos = self._positions(rows)
        found = (pos >= 0).nonzero().flatten()
        out = torch.full((rows.numel(),), -1, dtype=torch.int64)
        out.index_copy_(0, found, self.slots.index_select(0, pos.index_select(0, found)).long())
        return out

    def put(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows ``rows`` (distinct, int64 ``[n]``, not in the map) -> ``slots``: each in the first empty
        entry from its home; of rows reaching the same empty entry in a round, one takes it."""
        slots = slots.to(torch.int32)
        pos = self._home(rows)
        while rows.numel():
            # the rows reaching an empty entry all write it: one of them stays (a whole int64 each),
            # the others read another row back and probe on (which one stays changes the layout only,
            # never an answer; scatter_reduce's amin, deterministic, cost 3 ms a round on a 2 MiB map)
            empty = (self.keys.index_select(0, pos) < 0).nonzero().flatten()
            at, candidates = pos.index_select(0, empty), rows.index_select(0, empty)
            self.keys.index_copy_(0, at, candidates)
            won = torch.zeros(rows.numel(), dtype=torch.bool)
            won.index_copy_(0, empty, self.keys.index_select(0, at) == candidates)
            self.slots.index_copy_(0, pos[won], slots[won])
            left = ~won
            rows, slots, pos = rows[left], slots[left], (pos[left] + 1) & self._mask

    def erase(self, rows: torch.Tensor) -> None:
        """Rows ``rows`` (distinct, in the map) forgotten. The entries after an emptied one, up to the
        next empty entry, may have probed past it: they are taken out and put again (the vectorized
        form of a backward shift; no tombstones)."""
        pos = self._positions(rows)
        if bool((pos < 0).any()):
            raise RuntimeError(f"slot map: rows {rows[pos < 0][:8].tolist()} are not in the hashed map")
        self.keys.index_fill_(0, pos, -1)
        runs = []
        step = (pos + 1) & self._mask
        while step.numel():  # the runs after the emptied entries (disjoint: each ends at an empty one)
            step = step[self.keys.index_select(0, step) >= 0]
            runs.append(step)
            step = (step + 1) & self._mask
        moved = torch.cat(runs) if runs else pos[:0]
        if moved.numel():
            keys, slots = self.keys.index_select(0, moved), self.slots.index_select(0, moved)
            self.keys.index_fill_(0, moved, -1)
            self.put(keys, slots)

    def clear(self, row_of_slot: torch.Tensor) -> None:
        self.keys.fill_(-1)

    def refill(self, row_of_slot: torch.Tensor) -> None:
        """The map of the rows in ``row_of_slot`` (``[size]``), sized for ``size`` slots."""
        self._allocate(hash_entries(row_of_slot.numel()))
        resident = (row_of_slot >= 0).nonzero().flatten()
        self.put(row_of_slot.index_select(0, resident), resident)


SlotMap = Union[DenseSlotMap, HashSlotMap]


def make_slot_map(kind: str, num_rows: int, size: int, device: torch.device, padded: bool = False) -> SlotMap:
    """An empty map of ``kind`` for ``num_rows`` table rows and ``size`` slots (dense: on ``device``, with
    ``padded`` its extra entry ``R`` of -2 for the device bookkeeping)."""
    if kind == "dense":
        return DenseSlotMap(num_rows, device, padded)
    if padded:
        raise ValueError("the device bookkeeping needs the dense slot map (choose_slot_map picks it there)")
    return HashSlotMap(num_rows, size)


__all__ = [
    "DENSE_SHARE",
    "DenseSlotMap",
    "HASH_BYTES_PER_SLOT",
    "HashSlotMap",
    "SLOT_BOOKKEEPING_BYTES",
    "SLOT_MAP_ENV",
    "SlotMap",
    "choose_slot_map",
    "hash_entries",
    "make_slot_map",
]
