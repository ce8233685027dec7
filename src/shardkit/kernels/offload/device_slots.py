"""A row cache's bookkeeping on the cache's own device (L0): the CUDA tier without a host round trip a row.

On the host path (``cache_slots.py``) a CUDA cache's acquire brings its ids to the host, runs the
lookup, victim choice, installs and stamps there (native C++ or torch ops on CPU tensors) and sends the
slots back: at ~70k distinct rows and ~27k misses a step that host work is the step (issue 24: 17.5 ms
a step against 3.6 ms in device memory on an H200). Here, as fbgemm's UVM cache keeps its LRU state on
the GPU, the same state lives on the cache's device and every step of an acquire is a torch op there:

- ``slot_of_row`` int32 ``[R]`` and ``row_of_slot`` int64 ``[C]``: the two maps;
- ``_stamp`` int64 ``[C]`` (last acquire, LRU), ``_freq`` int64 ``[C]`` (acquisitions since loaded,
  LFU), ``_dirty`` bool ``[C]``, ``_pins`` int32 ``[C]`` (acquires in flight that hold the slot: +1 at
  acquire, -1 at release, both queued on the stream, so a release never waits for the device);
- victims: the evictable slots ordered by one stable device sort of their key (free slots first, then
  LRU: the stamp; LFU: (count, stamp); pinned slots last), the first ``misses`` taken;
- misses gathered from the host memory by the GPU (zero-copy, ``device_copies.py``) on the copy stream,
  dirty victims scattered back to it before their slots are refilled, on the same stream.

**One host sync an acquire**: the distinct-row count, the misses, the pinned slots, the dirty victims,
the ids' range and the count of ids the caller's own check rejects (``IdCheck``: an offloaded lookup's
shard bounds, so that it needs no sync of its own) come to the host together (one copy of at most 7
numbers), because the shapes of what follows (how many rows to gather and to write back) and the
counters depend on them. The ids are deduplicated by a sort without ``torch.unique``'s own sync (arrays
padded to the number of ids with row R, whose entry ``_slot_map.padded[R]`` = -2 is neither a hit nor a miss,
until the counts are known); the free slots are counted on the host (``_resident``). A release, the
stamps, the pins and the copies queue without waiting. The rare paths (growth when the pinned rows
exceed the cache, shrinking, flush, invalidate) sync as they need.

Few ops: an acquire is a fixed number of torch ops whatever the batch (51 that are not views, for a
weight and one optimizer state field, on CPU tensors; ``benchmarks/offload_gpu_syncs.py`` counts them;
80 before issue 24's second round, docs/offload/cuda.md): buffers of fixed content are kept across
acquires (an arange, ones, the dedup scratch), ``nonzero_static`` picks the misses and dirty victims
(its size known after the sync), a free slot's stamp and count are 0 (so the stamp alone orders free
slots first), and an evicted slot's state is not reset, since the miss installed into it in the same
acquire rewrites it.

The replacement is the host path's exactly: the same victims (free slots first, ascending; then the
smallest stamps, or (counts, stamps), ties by slot), the same slots for the same misses (ascending
victims to ascending rows), the same stamps (ascending rows within ``acquire_ids``; the given order in
``acquire``), the same counters (tests/kernels/offload/test_row_cache_device.py compares them step by
step). It costs a sort over the cache's slots per acquire, on the device.

The acquires and releases of one cache run on one CUDA stream (the default stream, normally: autograd
runs a backward, and so its release, on its forward's stream); the ops are ordered by it. Enforced
(``_bind_stream``): another stream is a RuntimeError saying why while a ticket is pinned, and takes
over (after waiting for the old one) once none is.

A mixin of :class:`~shardkit.kernels.offload.row_cache.RowCache`; every method runs under its lock.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch
from torch.torch_version import TorchVersion

from shardkit.kernels.offload.row_checks import IdCheck, checked_rows

ENV_VAR = "SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING"
MODES = ("host", "device")


def device_bookkeeping_setting() -> Optional[bool]:
    """``$SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING``: True (``1``), False (``0``), None (unset or ``auto``)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("0", "1", "false", "true", "off", "on", "no", "yes"):
        raise ValueError(f"{ENV_VAR}={value!r}: expected 0, 1 or auto")
    return value in ("1", "true", "on", "yes")


def choose_bookkeeping(
    requested: Optional[str],
    device: torch.device,
    backing: Dict[str, torch.Tensor],
    copies: Optional[Any],
    row_io: Optional[Any],
    write_behind: Optional[Any],
) -> Tuple[str, str]:
    """``(mode, why)``: where a new cache keeps its bookkeeping (``"host"`` / ``"device"``) and why.

    ``requested`` (the ``RowCache(bookkeeping=...)`` argument) wins; None reads the environment variable
    for a CUDA cache: unset / ``auto``, the device wherever it applies (else the host, ``why`` saying
    why); ``1``, the device or a ValueError naming why it cannot; ``0``, the host. A CPU cache keeps
    the host path unless ``requested`` is ``"device"`` (tests: the same torch ops on CPU tensors).
    The device path applies where the backing rows can be indexed from the cache's device: zero-copy
    views of pinned host memory (``DeviceCopies.views``), or a backing on that device itself; not with
    positioned file I/O (``row_io``), a write-behind thread or staged copies.
    """
    if requested is not None and requested not in MODES:
        raise ValueError(f"RowCache: bookkeeping must be one of {MODES} or None, got {requested!r}")
    setting = device_bookkeeping_setting()  # read (and a bad value refused) by every cache
    same_device = all(store.device == device for store in backing.values())
    if row_io is not None:
        blocker = "the backing is a file moved by positioned I/O (row_io)"
    elif write_behind is not None:
        blocker = "a write-behind thread writes the evicted rows"
    elif copies is not None and copies.views is None:
        blocker = "the host backing has no zero-copy device view (not pinned, or SHARDKIT_OFFLOAD_UVA=0)"
    elif copies is None and not same_device:
        blocker = "the copies run on the compute stream (SHARDKIT_OFFLOAD_COPY_STREAM=0)"
    else:
        blocker = None
    if requested == "host":
        return "host", "asked for (bookkeeping='host')"
    if requested == "device":
        if blocker is not None:
            raise ValueError(f"RowCache: bookkeeping='device' cannot apply: {blocker}")
        return "device", "asked for (bookkeeping='device')"
    if device.type != "cuda":
        return "host", "a CPU cache keeps the host bookkeeping"
    if setting is False:
        return "host", f"{ENV_VAR}=0"
    if blocker is not None:
        if setting:
            raise ValueError(f"RowCache: {ENV_VAR}=1, but the device bookkeeping cannot apply: {blocker}")
        return "host", blocker
    return "device", f"{ENV_VAR}={'1' if setting else 'auto (unset)'}"


# torch.nonzero_static runs on CUDA tensors (without a sync) from torch 2.6; on CPU tensors from 2.1
_STATIC_NONZERO_ON_CUDA = TorchVersion(torch.__version__) >= "2.6"


def static_nonzero_runs_on(device: torch.device) -> bool:
    """Whether ``torch.nonzero_static`` runs on ``device`` with this torch."""
    return device.type == "cpu" or (device.type == "cuda" and _STATIC_NONZERO_ON_CUDA)


def true_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """int64 ``[count]``: the ascending positions of the ``count`` True entries of the bool ``mask``
    (``count`` known on the host: no sync, unlike ``nonzero``). ``nonzero_static`` where it runs on
    ``mask``'s device, else a stable sort of the flags (older torch on CUDA: two ops more)."""
    if static_nonzero_runs_on(mask.device):
        return torch.nonzero_static(mask, size=count).flatten()
    return torch.argsort((~mask).to(torch.int8), stable=True)[:count]


class DeviceSlots:
    """An acquire with the bookkeeping on ``self._book_device`` (see the module docstring)."""

    def _init_device_scratch(self) -> None:
        """Buffers reused by every acquire (no allocation or fill a step): int64 ``_arange`` and
        ``_ones64``, int32 ``_ones32``, the dedup scratch ``_first`` (bool) and ``_segment`` (int64,
        ``[0]`` always 0) and the hits' pins ``_hits32``, of ``_scratch_size`` entries (written and
        read within one acquire, in the order of the cache's one stream); ``_stream``: the CUDA
        stream the acquires and releases run on (bound by the first one)."""
        self._scratch_size = 0
        self._stream: Optional[torch.cuda.Stream] = None
        if self.bookkeeping == "device":
            self._scratch(1)

    def _scratch(self, n: int) -> None:
        """The scratch buffers hold at least ``n`` entries (regrown, doubling, when they do not)."""
        if n <= self._scratch_size:
            return
        size = max(n, 2 * self._scratch_size, 1024)
        dev = self._book_device
        self._arange = torch.arange(size, device=dev)
        self._ones64 = torch.ones(size, dtype=torch.int64, device=dev)
        self._ones32 = torch.ones(size, dtype=torch.int32, device=dev)
        self._first = torch.ones(size, dtype=torch.bool, device=dev)
        self._segment = torch.zeros(size, dtype=torch.int64, device=dev)
        self._hits32 = torch.zeros(size, dtype=torch.int32, device=dev)
        self._scratch_size = size

    def _bind_stream(self, what: str) -> None:
        """Check that this acquire or release of a CUDA device-bookkept cache runs on the cache's stream.

        The pins, stamps and maps are updated by ops queued on the caller's stream, and the next
        acquire reads them in that stream's order: an acquire or release on another stream could run
        before the ops it depends on (a row evicted while a kernel still reads it, a pin released
        before it was taken). While no ticket is pinned a new stream takes over (it first waits for
        the old one); otherwise RuntimeError naming both streams and what to do."""
        if self._book_device.type != "cuda":
            return
        stream = torch.cuda.current_stream(self._book_device)
        if self._stream is None or stream == self._stream:
            self._stream = stream
            return
        if self._tickets or self._deferred:
            raise RuntimeError(
                f"RowCache.{what}: a cache with its bookkeeping on the device (kernels/offload/"
                f"device_slots.py) must be acquired and released on one CUDA stream, because its pins, "
                f"slot maps and stamps are updated by ops queued on that stream; tickets "
                f"{sorted(self._tickets)} were acquired on {self._stream} and this call runs on {stream}. "
                f"Run the acquires and releases (the lookup's forward and backward) under the same "
                f"stream (torch.cuda.stream(...)), release every ticket before switching streams, or "
                f"build the cache with bookkeeping='host'."
            )
        stream.wait_stream(self._stream)  # nothing in flight: the new stream after the old one's ops
        self._stream = stream

    def _order_slots(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(order, pinned)``: every slot, in the order slots are taken (free ascending, then evictable
        by the algorithm, pinned last), and the number of pinned slots (0-d device tensor).

        A free slot's stamp and count are 0 and a resident slot's are >= 1 (every acquire stamps and
        counts all of its slots; eviction, growth, shrinking and invalidation zero them), so the stamp
        alone puts the free slots first."""
        pinned = self._pins > 0
        last = torch.iinfo(torch.int64).max
        if self.algorithm == "lru":
            order = torch.argsort(torch.where(pinned, last, self._stamp), stable=True)
        else:  # (count, stamp, slot): by stamp, then stably by count
            by_stamp = torch.argsort(self._stamp, stable=True)
            count_key = torch.where(pinned, last, self._freq)
            order = by_stamp.index_select(0, torch.argsort(count_key.index_select(0, by_stamp), stable=True))
        return order, pinned.sum()

    def _acquire_device(
        self,
        ids: torch.Tensor,
        commit_order: Optional[torch.Tensor] = None,
        id_check: Optional[IdCheck] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Acquire the distinct rows of ``ids`` (integer ``[N]``, ``N > 0``, on the bookkeeping device):
        ``(ticket_slots, slot_ids)``, the distinct slots (ascending rows, or in the order of
        ``commit_order``, distinct rows already checked, which are then also stamped in that order)
        and each id's slot (int64 ``[N]``). Raises RowOutOfRange for an id outside ``[0, R)``, or
        ``id_check``'s error (checked in the same host sync)."""
        dev = self._book_device
        n = ids.numel()
        self._scratch(n)
        ids = ids.to(torch.int64)
        sorted_ids = torch.sort(ids).values
        # dedup without torch.unique (its size needs a sync): a distinct row's first sorted position
        # starts a segment; the segment numbers (a cumsum) scatter the rows to the front of `distinct`
        first, segment = self._first[:n], self._segment[:n]
        torch.ne(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
        torch.cumsum(first[1:], 0, dtype=torch.int64, out=segment[1:])
        # padded with row R, whose entry in the padded dense map (_slot_map.padded[R]) is -2: neither a
        # hit nor a miss
        distinct = torch.full((n,), self.num_rows, dtype=torch.int64, device=dev)
        distinct.scatter_(0, segment, sorted_ids)
        looked = self._slot_map.padded.index_select(0, distinct.clamp(0, self.num_rows))  # int32
        miss = looked == -1
        # the hits' pins: 1 a hit (written as int32 by the comparison itself); padded and missing
        # entries add 0 to slot 0 (no nonzero: its size would need a sync)
        hit_slots, hit_pins = looked.clamp(min=0), torch.ge(looked, 0, out=self._hits32[:n])
        if self.size:  # no slots: no hits either
            self._pins.index_add_(0, hit_slots, hit_pins)  # first: the hits are never victims here
        misses = miss.sum()
        taken_order, pinned = self._order_slots()
        head = taken_order[: min(n, self.size)]  # the misses' slots are among these
        written = (self._arange[: head.numel()] < misses) & self._dirty.index_select(0, head)
        stats = [segment[-1], misses, pinned, written.sum(), sorted_ids[0], sorted_ids[-1]]
        if id_check is not None and id_check.bad is not None:
            stats.append(id_check.bad.to(torch.int64).reshape(()))
        last, misses, pinned, writes, low, high, *bad = torch.stack(stats).tolist()  # the one host sync
        count, available, free = last + 1, self.size - pinned, self.size - self._resident
        evicted = None
        try:
            if low < 0 or high >= self.num_rows or (bad and bad[0]):
                self._raise_bad_ids(distinct[:count], id_check)
            if misses > available:
                # the pinned rows exceed the cache: grow so that every miss fits, then every free and
                # evictable slot goes (as on the host path); this rare path syncs again
                self._grow(self.size + misses - available)
                head = self._order_slots()[0][:misses]
                written = self._dirty.index_select(0, head)
                writes, free = int(written.sum()), self.size - self._resident
            victims = head[:misses]
            self._evict_device(victims, written[:misses], writes, min(misses, free))
            evicted = victims  # their rows dropped from the map: a failure from here on frees them
            miss_rows = distinct.index_select(0, true_positions(miss, misses))
            new_slots = victims.sort().values
            self._read_rows(miss_rows, new_slots)
        except BaseException:
            if self.size:
                self._pins.index_add_(0, hit_slots, -hit_pins)
            if evicted is not None:  # the victims' rows are gone: their slots are free now
                self._free_slots_device(evicted)
            raise
        self._install_device(miss_rows, new_slots)
        rows = distinct[:count] if commit_order is None else commit_order
        slots = self.slot_of_row.index_select(0, rows).long()
        self._stamp.index_copy_(0, slots, self._arange[:count] + self._clock)
        self._freq.index_add_(0, slots, self._ones64[:count])
        self._clock += count
        self.counters.lookups += count
        self.counters.hits += count - misses
        self.counters.misses += misses
        if commit_order is not None:
            return slots, slots
        return slots, self.slot_of_row.index_select(0, ids).long()

    def _raise_bad_ids(self, distinct: torch.Tensor, id_check: Optional[IdCheck]) -> None:
        """The error for ids the caller's check rejects or outside ``[0, R)`` (syncs again: error path)."""
        if id_check is not None:
            id_check.raise_error()  # the caller's error, naming its feature and table
        checked_rows(distinct.cpu(), self.num_rows)  # raises RowOutOfRange, naming the row
        raise IndexError("RowCache.acquire_ids: the caller's id check rejected ids without naming one")

    def _evict_device(self, victims: torch.Tensor, written: torch.Tensor, writes: int, free: int) -> None:
        """Drop the rows of ``victims`` (int64, the ``free`` free slots first), writing back the
        ``writes`` dirty ones (``written``: bool per victim). Only the map of the dropped rows changes:
        every victim is refilled by :meth:`_install_device` in the same acquire, which rewrites the
        slots' row, dirty flag, stamp and count (or freed by :meth:`_free_slots_device` on a failure)."""
        if writes:
            picked = victims.index_select(0, true_positions(written, writes))  # the dirty victims
            # any order: a zero-copy scatter (or a tensor's index_copy_) does not read the file in order
            self._write_back(self.row_of_slot.index_select(0, picked), picked, ordered=True)
            self._dirty.index_fill_(0, picked, False)  # the other victims are clean already
        evicted = victims[free:]
        if evicted.numel():
            self.slot_of_row.index_fill_(0, self.row_of_slot.index_select(0, evicted), -1)
            self._resident -= evicted.numel()
            self.counters.evictions += evicted.numel()

    def _free_slots_device(self, slots: torch.Tensor) -> None:
        """``slots`` free: no row, clean, unstamped (a failed acquire's victims, their rows already
        dropped from the map and from ``_resident`` by :meth:`_evict_device`)."""
        self.row_of_slot.index_fill_(0, slots, -1)
        self._dirty.index_fill_(0, slots, False)
        self._stamp.index_fill_(0, slots, 0)
        self._freq.index_fill_(0, slots, 0)

    def _install_device(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Loaded ``rows`` resident in ``slots``: count 0, pinned once (by their acquire); their stamps
        are written by the acquire's stamping, which covers them, and they are clean (free slots are,
        and :meth:`_evict_device` cleaned the dirty victims it wrote back)."""
        if not rows.numel():
            return
        self.slot_of_row.index_copy_(0, rows, slots.to(torch.int32))
        self.row_of_slot.index_copy_(0, slots, rows)
        self._freq.index_fill_(0, slots, 0)
        self._pins.index_add_(0, slots, self._ones32[: slots.numel()])
        self._resident += rows.numel()


__all__ = ["ENV_VAR", "DeviceSlots", "choose_bookkeeping", "device_bookkeeping_setting", "true_positions"]
