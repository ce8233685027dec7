"""The fast tier of an offloaded table: a cache of rows in front of a slow backing store (L0).

A table shard's fields (its weights, its fused optimizer state, ...) live in a *backing store*: a dict of
tensors that share their first dimension ``R`` (mmap'd file views on CPU, pinned host memory under a CUDA
cache, plain tensors in tests). :class:`RowCache` keeps up to ``capacity`` of those rows in *fast-tier*
buffers (:attr:`RowCache.tensors`, one ``[C, *width]`` tensor per field on :attr:`RowCache.device`), and
maps each requested row to its *slot* there. The embedding kernels then run on the cache's tensors with
the ids remapped to slots, so their results are bitwise those of the same kernels on an in-memory table:
the cache only moves rows, it never computes with them.

Protocol (one batch)::

    ticket, slots = cache.acquire(rows)     # rows: distinct int64 [U]; slots: int64 [U] on cache.device
    weight = cache.tensors["weight"]        # read the buffers AFTER acquire (it may have grown them)
    ... lookups on weight[slots], in-place updates of the slots' rows ...
    cache.release(ticket, dirty=True)       # dirty: the slots' rows were updated in place

The lookups call ``ticket, slot_ids = cache.acquire_ids(ids)`` instead: the step's ids (repeats, any
order) deduplicated, acquired as ``acquire(torch.unique(ids))`` would, and each remapped to its slot
(``csrc/row_cache_ids.cpp`` where the native ops are built: two passes, no sort of the ids).

- Hits keep their slot; misses take free slots, else evict unpinned slots chosen by the replacement
  algorithm (``"lru"``: least recently acquired; ``"lfu"``: fewest acquisitions since loaded, ties broken
  by LRU). A dirty victim is written back to the backing store before its slot is reused (or, with a
  ``write_behind``, copied out of its slot and written by that thread; counted in ``rows_written`` when
  handed over).
- Rows of an unreleased ticket are *pinned*: never evicted (so a prefetch of batch i+1 cannot disturb
  batch i in flight). If the unpinned slots cannot hold a request, every buffer *grows* (reallocated,
  old content copied, existing slots stay valid) so that the whole request fits; once no ticket is
  pinned the cache shrinks back to ``capacity`` (evicting by the same algorithm, writing dirty rows
  back). ``capacity = 0`` is valid: the cache then holds only the pinned working set and writes every
  dirty row back at release.
- :meth:`RowCache.flush` writes back all dirty rows (they stay cached, now clean);
  :meth:`RowCache.invalidate` flushes, then forgets all rows (after someone wrote the backing directly).

Because growth and shrinking reallocate the buffers, a caller must read :attr:`RowCache.tensors` again
after every :meth:`~RowCache.acquire` and :meth:`~RowCache.release` (:attr:`RowCache.buffers_version`
counts reallocations); a reference kept across them may point at a dropped buffer.

Threads: a background thread may :meth:`~RowCache.acquire` (a prefetch) while the main thread runs a
kernel on the slots of a pinned ticket and then releases it. Every operation on the bookkeeping (the slot
map, pins, dirty flags, recency and frequency, counters) holds one lock, so one thread at a time touches
it. :meth:`~RowCache.release` never waits for that lock: while another thread holds it, the release is
queued and applied (in order) by the next operation that takes the lock; until then its rows stay pinned,
so a queued release can delay an eviction but never lose a dirty row. A kernel that reads or writes
:attr:`~RowCache.tensors` outside the cache's methods holds :meth:`~RowCache.buffers_in_use`, which the
reallocations (growth, shrinking) wait for, so an in-place update never lands in a dropped buffer; a
concurrent acquire writes only free or evicted (unpinned) slots, never the rows of a pinned ticket.

Bookkeeping: the slot map, row -> slot (``slot_map.py``): dense, int32 ``[R]`` (4 bytes a row of the
table), or hashed, open addressing over ``H >= 2 C`` entries (12 bytes each, whatever ``R``), chosen by
size (:func:`~shardkit.kernels.offload.slot_map.choose_slot_map`, ``$SHARDKIT_OFFLOAD_SLOT_MAP``); and
per-slot ``row_of_slot`` int64, recency stamp int64, frequency int64, pin count int32 and dirty flag,
all ``[C]``. On the host (:attr:`RowCache.bookkeeping` ``"host"``, every CPU cache), a replacement queue
(``slot_queue.py``) hands out the victims in eviction order without a selection over the cache. On a
CUDA cache with zero-copy copies they live on the device instead (``"device"``, ``device_slots.py``:
torch ops there, one host sync an acquire, the same victims; ``$SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING``).
``acquire_ids`` (the lookups' entry: deduplicate, acquire, remap) is in ``acquire_ids.py``. Misses are
read and victims written back in ascending row order (``row_moves.py``); a batch's host
bookkeeping steps on both paths are in ``cache_slots.py``, growth and shrinking in ``cache_resize.py``.

Two paths, the same results (tests/kernels/offload/test_row_cache_native.py): where the native kernels
are built, every per-batch step of the bookkeeping is a native op, one C++ loop each (``csrc/row_cache.cpp``:
the hit / miss split with the hits' pins, the victims' dirty rows and their removal from the maps, the
loaded rows' installation and pins, an acquire's stamps and counts, a release; ``csrc/row_cache_queue.cpp``:
the LRU and LFU queue), so the Python code of an acquire is a fixed handful of calls whatever the batch;
otherwise (``SHARDKIT_NATIVE=0``, ``kernel_backend("torch")``, :attr:`RowCache.use_native` = False) the
pure-torch path does the same with vectorized torch ops (index_select / index_copy_, an LRU queue of
tensors, LFU by a selection over the evictable slots).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from shardkit.kernels.offload.acquire_ids import AcquireIds
from shardkit.kernels.offload.cache_counters import CacheCounters
from shardkit.kernels.offload.cache_resize import CacheResize
from shardkit.kernels.offload.cache_slots import CacheSlots, ones_int32
from shardkit.kernels.offload.device_copies import DeviceCopies, copy_stream_default
from shardkit.kernels.offload.device_slots import DeviceSlots, choose_bookkeeping
from shardkit.kernels.offload.row_checks import IdCheck, checked_rows
from shardkit.kernels.offload.row_moves import RowMoves
from shardkit.kernels.offload.slot_map import (
    SLOT_BOOKKEEPING_BYTES,
    SlotMap,
    choose_slot_map,
    make_slot_map,
)
from shardkit.kernels.offload.slot_queue import NativeSlotQueue, TorchLruQueue

ALGORITHMS = ("lru", "lfu")


def _algorithm_name(algorithm: object) -> str:
    # accepts "lru" / "LFU" and enum members such as torchrec's CacheAlgorithm.LRU (by their name)
    name = getattr(algorithm, "name", algorithm)
    if not isinstance(name, str) or name.lower() not in ALGORITHMS:
        raise ValueError(f"RowCache: unknown cache algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    return name.lower()


class RowCache(AcquireIds, CacheSlots, DeviceSlots, RowMoves, CacheResize):
    """A cache of ``capacity`` rows of ``backing`` in buffers on ``device`` (see the module docstring).

    Args:
        backing: field name -> tensor ``[R, *width]`` (any dtype, all on one device, same ``R``); the slow
            tier. Written in place (``index_copy_``) when dirty rows are written back.
        capacity: rows the cache holds when no ticket is pinned (``>= 0``; more than ``R`` is clamped to
            ``R``, which already holds the whole table).
        algorithm: ``"lru"`` or ``"lfu"`` (or an enum member with that name).
        device: where the fast-tier buffers live (default CPU). The backing may be on another device
            (host memory behind a CUDA cache): rows are copied with ``.to``.
        io_chunk_rows, after_io: rows are read from / written back to the backing store at most
            ``io_chunk_rows`` at a time (None: all at once), ``after_io()`` called after each chunk. A
            mapped file's store passes its ``drop_resident`` here, so that the pages one batch's misses
            map stay bounded by the chunk, not by the misses.
        row_io: optional positioned I/O of the backing store's rows (a
            :class:`~shardkit.kernels.offload.row_io.FileRowIO` with ``read_into(rows, buffers, slots)``
            and ``write_from(rows, buffers, slots)``, over the same fields as ``backing`` or, if it has
            ``regions``, over those fields only (the others move through their ``backing`` tensors), on
            the host):
            misses are read straight into their slots and victims written straight from theirs through it
            (``preadv`` / ``pwritev``, native C++ when built) instead of through the
            ``backing`` tensors, so a mapped file's pages are never faulted in (``after_io`` is then
            not needed).
        write_behind: optional :class:`~shardkit.kernels.offload.write_behind.WriteBehind` (host
            buffers only): an eviction's dirty rows are copied out of their slots and written by its
            background thread; misses whose write is pending wait for it, flushes wait for all.
        bookkeeping: ``"host"``, ``"device"`` or None (the default: the device for a CUDA cache where it
            applies, per ``$SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING``; the host for a CPU cache). See
            :func:`~shardkit.kernels.offload.device_slots.choose_bookkeeping`; ValueError where
            ``"device"`` cannot apply.
        slot_map: ``"dense"``, ``"hash"`` or None (the default: ``$SHARDKIT_OFFLOAD_SLOT_MAP``, else the
            rule of :func:`~shardkit.kernels.offload.slot_map.choose_slot_map`: dense while its 4 bytes
            a table row are small against the cache). ValueError for another value, or ``"hash"`` under
            the device bookkeeping.

    Attributes:
        tensors: field name -> fast-tier buffer ``[size, *width]``, the backing field's dtype, contiguous,
            on ``device``; ``size >= capacity`` while tickets are pinned.
        slot_of_row: int32 ``[R]``, the slot of each cached row, -1 for the others (on the host, or on
            :attr:`device` under the device bookkeeping, as are the per-slot arrays): the dense map itself,
            or, with a hashed map, a copy made on each read (``R`` entries: for inspection and tests).
        slot_map_kind, slot_map_reason: ``"dense"`` or ``"hash"`` (``slot_map.py``), and why.
        row_of_slot: int64 ``[size]``, the row in each slot, -1 for a free slot.
        bookkeeping, bookkeeping_reason: ``"host"`` or ``"device"``, and why (which setting chose it).
        counters: the :class:`CacheCounters`.
        row_bytes: bytes of one row over all fields.
    """

    # the replacement queue is rebuilt from the stamps once it holds 3x this many entries or 3x the slots
    # (its stale entries are otherwise dropped only when they reach the front)
    QUEUE_REBUILD_MIN_ENTRIES = 1024

    def __init__(
        self,
        backing: Dict[str, torch.Tensor],
        capacity: int,
        algorithm: object = "lru",
        device: Optional[Union[torch.device, str]] = None,
        io_chunk_rows: Optional[int] = None,
        after_io: Optional[Callable[[], None]] = None,
        row_io: Optional[Any] = None,
        write_behind: Optional[Any] = None,
        bookkeeping: Optional[str] = None,
        slot_map: Optional[str] = None,
    ) -> None:
        if not isinstance(backing, dict) or not backing:
            raise ValueError("RowCache: backing must be a non-empty dict of field name -> tensor [R, *width]")
        num_rows = None
        for name, store in backing.items():
            if not isinstance(store, torch.Tensor) or store.dim() < 1:
                raise ValueError(
                    f"RowCache: backing field {name!r} must be a tensor [R, *width], "
                    f"got {type(store).__name__}"
                    + (f" of shape {tuple(store.shape)}" if isinstance(store, torch.Tensor) else "")
                )
            if num_rows is None:
                num_rows, first = store.shape[0], name
            elif store.shape[0] != num_rows:
                raise ValueError(
                    f"RowCache: backing fields disagree on the number of rows: {first!r} has {num_rows}, "
                    f"{name!r} has {store.shape[0]}"
                )
        devices = {store.device for store in backing.values()}
        if len(devices) > 1:
            raise ValueError(f"RowCache: backing fields are on several devices {sorted(map(str, devices))}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"RowCache: capacity must be an int >= 0 (rows), got {capacity!r}")
        if io_chunk_rows is not None and (
            isinstance(io_chunk_rows, bool) or not isinstance(io_chunk_rows, int) or io_chunk_rows < 1
        ):
            raise ValueError(f"RowCache: io_chunk_rows must be an int >= 1 or None, got {io_chunk_rows!r}")
        self.io_chunk_rows = io_chunk_rows
        self._after_io = after_io
        self._row_io = row_io
        # fields the row_io does not cover (a row_io with ``regions`` naming some fields only): moved with
        # index ops on their backing tensors, e.g. a narrow optimizer state kept mapped in memory
        # (BackingStore.keep_fields_mapped): a copy of a few bytes instead of a system call per row
        regions = getattr(row_io, "regions", None)
        self._direct_fields: List[str] = []
        if row_io is not None and regions is not None:
            unknown = sorted(set(regions) - set(backing))
            if unknown:
                raise ValueError(f"RowCache: row_io moves fields {unknown} that the backing does not have")
            self._direct_fields = [name for name in backing if name not in regions]
        if write_behind is not None and (device is not None and torch.device(device).type != "cpu"):
            raise ValueError(f"RowCache: write_behind needs host buffers, the cache is on {device}")
        self._write_behind = write_behind
        self.algorithm = _algorithm_name(algorithm)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.backing = backing
        self.num_rows = int(num_rows)
        self.capacity = min(capacity, self.num_rows)
        self.row_bytes = sum(s.element_size() * math.prod(s.shape[1:]) for s in backing.values())
        self.counters = CacheCounters()
        # False: the pure-torch bookkeeping even where the native ops are built (tests compare the two)
        self.use_native = True
        self.buffers_version = 0
        # a CUDA cache over host memory: copies on a side stream (device_copies.py), and per ticket the
        # event its kernels wait for; None: copies on the caller's stream
        host_backing = all(store.device.type == "cpu" for store in backing.values())
        self._copies: Optional[DeviceCopies] = (
            DeviceCopies(self.device, backing)
            if self.device.type == "cuda" and host_backing and row_io is None and copy_stream_default()
            else None
        )
        self._loaded: Dict[int, Any] = {}
        # where the slot maps, pins, stamps and counts live (device_slots.py): "device" on a CUDA cache
        # with zero-copy copies unless $SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING=0; why, for the record
        self.bookkeeping, self.bookkeeping_reason = choose_bookkeeping(
            bookkeeping, self.device, backing, self._copies, row_io, write_behind
        )
        book = self._book_device = self.device if self.bookkeeping == "device" else torch.device("cpu")
        self.tensors: Dict[str, torch.Tensor] = {
            name: torch.zeros((self.capacity, *s.shape[1:]), dtype=s.dtype, device=self.device)
            for name, s in backing.items()
        }
        # row -> slot (slot_map.py): dense (4 bytes a table row) or hashed (O(slots)), by the rule of
        # choose_slot_map unless slot_map / $SHARDKIT_OFFLOAD_SLOT_MAP says which; why, for the record
        self.slot_map_kind, self.slot_map_reason = choose_slot_map(
            slot_map, self.num_rows, self.capacity, self.row_bytes, self.bookkeeping == "device"
        )
        self._slot_map: SlotMap = make_slot_map(
            self.slot_map_kind, self.num_rows, self.capacity, book, padded=self.bookkeeping == "device"
        )
        self._init_device_scratch()
        self.row_of_slot = torch.full((self.capacity,), -1, dtype=torch.int64, device=book)
        self._resident = 0  # slots holding a row: when all do, no scan for free ones
        self._dirty = torch.zeros(self.capacity, dtype=torch.bool, device=book)
        self._pins = torch.zeros(self.capacity, dtype=torch.int32, device=book)
        self._stamp = torch.zeros(self.capacity, dtype=torch.int64, device=book)  # larger: acquired later
        self._freq = torch.zeros(self.capacity, dtype=torch.int64, device=book)  # acquisitions since loaded
        self._clock = 1  # stamps start at 1: 0 marks a slot never stamped since loaded / freed
        # the replacement queue (slot_queue.py): the victims in eviction order, without a selection over
        # the cache; which one depends on the path (native or torch), set by the first acquire
        self._queue: Optional[Union[NativeSlotQueue, TorchLruQueue]] = None
        self._queue_kind: Optional[str] = None
        self._tickets: Dict[int, torch.Tensor] = {}  # ticket -> its slots, int64 [U] on the host
        self._next_ticket = 0
        # one thread at a time in the bookkeeping (a background prefetch acquires while the main thread
        # releases); releases that found it taken wait in _deferred, applied by the next holder
        self._lock = threading.Lock()
        self._deferred: List[Tuple[int, bool]] = []
        self._deferred_lock = threading.Lock()  # guards _deferred only (never held with another lock)
        # held by kernels using the buffers in place and by the reallocations (reentrant: a release in
        # such a block may shrink; the caller then re-reads tensors, as after any release)
        self._buffers_lock = threading.RLock()

    # ------------------------------------------------------------------ public interface

    @property
    def size(self) -> int:
        """Slots allocated now: ``capacity``, or more while pinned tickets need them."""
        return self.row_of_slot.numel()

    @property
    def slot_of_row(self) -> torch.Tensor:
        """int32 ``[R]``: the dense map itself, or a copy of the hashed one (see the class docstring)."""
        return self._slot_map.dense()

    @property
    def bookkeeping_bytes(self) -> int:
        """Bytes of the slot map and the per-slot arrays now (not the replacement queue nor a batch's
        temporaries): ``4 R + 29 size`` with the dense map, ``12 H + 29 size`` with the hashed one."""
        return self._slot_map.nbytes + SLOT_BOOKKEEPING_BYTES * self.size

    @property
    def pinned_tickets(self) -> Tuple[int, ...]:
        """The tickets acquired and not yet released (waits for an acquire in another thread)."""
        with self._locked():
            return tuple(self._tickets)

    @contextlib.contextmanager
    def buffers_in_use(self) -> Iterator[None]:
        """Hold while a kernel reads or writes :attr:`tensors` in place (the slots of a pinned ticket):
        growth or shrinking in another thread waits until the block ends. Read :attr:`tensors` inside."""
        with self._buffers_lock:
            yield

    @contextlib.contextmanager
    def _locked(self, what: Optional[str] = None) -> Iterator[None]:
        """The bookkeeping lock, with the releases queued while another thread held it applied first
        (and, for a CUDA cache with the device bookkeeping, the check that ``what``, a method that
        queues or reads bookkeeping ops, runs on its stream: ``DeviceSlots._bind_stream``)."""
        with self._lock:
            if what is not None and self.bookkeeping == "device":
                self._bind_stream(what)
            self._apply_deferred()
            yield

    def _apply_deferred(self) -> None:
        while True:
            with self._deferred_lock:
                if not self._deferred:
                    return
                ticket, dirty = self._deferred.pop(0)
            self._release(ticket, dirty)

    def acquire(self, rows: torch.Tensor, wait_copies: bool = True) -> Tuple[int, torch.Tensor]:
        """Make ``rows`` resident and pin them until :meth:`release` of the returned ticket.

        Args:
            rows: distinct row numbers in ``[0, R)``, an integer tensor ``[U]`` on any device; ``U = 0``
                is fine.
            wait_copies: a CUDA cache copies its misses on a side stream: True makes the current stream
                wait for them before returning; False leaves that to the caller, who calls
                :meth:`wait_loaded` on the stream of the kernel that reads the slots, later (a prefetch:
                the kernels queued meanwhile overlap the copies). Ignored by other caches.
        Returns:
            ``(ticket, slots)``: an int for :meth:`release`, and int64 ``[U]`` on :attr:`device`,
            ``slots[i]`` the slot of ``rows[i]`` in every tensor of :attr:`tensors`.
        Raises:
            RowOutOfRange (an IndexError) for a row outside ``[0, R)``; ValueError for a repeated row;
            TypeError / ValueError for a tensor that is not a 1-D integer tensor.
        """
        rows, ascending = checked_rows(rows, self.num_rows)
        with self._locked("acquire"):
            if self.bookkeeping == "device":
                rows = rows.to(self._book_device)  # checked; also the order of their stamps
                ticket, slots = self._acquire_on_device(rows, rows)
            else:
                ticket, slots = self._acquire(rows, ascending)
        if wait_copies:
            self.wait_loaded(ticket)
        return ticket, slots

    def _acquire_on_device(
        self,
        ids: torch.Tensor,
        commit_order: Optional[torch.Tensor] = None,
        id_check: Optional[IdCheck] = None,
    ) -> Tuple[int, torch.Tensor]:
        """The device bookkeeping's acquire (``device_slots.py``): ``(ticket, slot_ids)``."""
        if ids.numel():
            slots, slot_ids = self._acquire_device(ids, commit_order, id_check)
        else:
            slots = slot_ids = torch.zeros(0, dtype=torch.int64, device=self._book_device)
        return self._issue_ticket(slots), slot_ids.to(self.device)

    def _issue_ticket(self, slots: torch.Tensor) -> int:
        """A new ticket pinning ``slots`` (their pins already taken)."""
        ticket = self._next_ticket
        self._next_ticket += 1
        self._tickets[ticket] = slots
        if self._copies is not None:
            self._loaded[ticket] = self._copies.mark()
        return ticket

    def _acquire(self, rows: torch.Tensor, ascending: bool) -> Tuple[int, torch.Tensor]:
        native = self._native()
        self._sync_queue(native)
        looked, miss_rows = self._lookup(rows, native)
        return self._acquire_looked(rows, looked, miss_rows, ascending, native)

    def _acquire_looked(
        self,
        rows: torch.Tensor,
        looked: torch.Tensor,
        miss_rows: torch.Tensor,
        ascending: bool,
        native: Optional[Any],
        inverse: Optional[torch.Tensor] = None,
    ) -> Tuple[int, torch.Tensor]:
        """The rest of an acquire once ``rows`` were looked up (``looked``: their slots, -1 = miss; the
        hits pinned): the misses loaded, the stamps and counts, the ticket. ``inverse`` (native path
        only): also remap ids to slots, returning ``slots[inverse]`` instead of ``slots``."""
        loaded = None
        try:
            if not ascending:
                miss_rows = miss_rows.sort().values  # ascending: sequential reads of the backing store
            if miss_rows.numel():
                loaded = self._free_slots(miss_rows.numel())
                self._load(miss_rows, loaded)  # pins them
        except BaseException:
            hit_slots = looked[looked >= 0]
            self._pins.index_add_(0, hit_slots, ones_int32(hit_slots.numel(), -1))
            if self._queue is not None:  # rows loaded before the failure stay, unstamped: first in line
                self._rebuild_queue()
            raise
        count = rows.numel()
        slot_ids = None
        if inverse is not None:
            if loaded is None:
                loaded = looked[:0]
            slots, slot_ids = native.row_cache_commit_ids(
                looked, loaded, inverse, rows, self.row_of_slot, self._stamp, self._freq, self._clock
            )
        else:
            slots = self._commit(rows, looked, miss_rows, native)
        if self._queue is not None and count:
            self._queue.push(slots, self._clock, self._freq)
            if self._queue.entries > 3 * max(self.size, self.QUEUE_REBUILD_MIN_ENTRIES):
                self._rebuild_queue()
        self._clock += count
        misses = int(miss_rows.numel())
        self.counters.lookups += count
        self.counters.hits += count - misses
        self.counters.misses += misses
        ticket = self._issue_ticket(slots)
        return ticket, (slots if slot_ids is None else slot_ids).to(self.device)

    def wait_loaded(self, ticket: int) -> None:
        """Make the current CUDA stream wait until the rows of ``ticket`` are in their slots (the copies
        of a CUDA cache run on a side stream, ``device_copies.py``); a no-op for other caches. Call it
        before a kernel reads the ticket's slots, on the stream that runs the kernel."""
        event = self._loaded.get(ticket)  # read without the lock: set before the ticket was returned
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def release(self, ticket: int, dirty: bool) -> None:
        """Unpin the slots of ``ticket``; ``dirty``: the caller updated their rows in place.

        When no ticket is left pinned and the cache grew beyond ``capacity``, it shrinks back (evicting
        by the algorithm, writing dirty rows back; :attr:`tensors` are reallocated). While another
        thread is in the cache (an acquire), the release is queued instead of waiting: the next
        operation applies it, and the ticket's rows stay pinned until then.
        Raises ValueError for a ticket never issued or already released.
        """
        if self.bookkeeping == "device":
            self._bind_stream("release")  # on the stream of the acquires (checked before queuing)
        if not self._lock.acquire(blocking=False):
            with self._deferred_lock:  # checked and queued at once: a second release is an error now
                if ticket not in self._tickets or any(t == ticket for t, _ in self._deferred):
                    self._raise_bad_ticket(ticket)
                self._deferred.append((ticket, dirty))
            return
        try:
            self._apply_deferred()
            self._release(ticket, dirty)
        finally:
            self._lock.release()

    def _raise_bad_ticket(self, ticket: object) -> None:
        if isinstance(ticket, int) and 0 <= ticket < self._next_ticket:
            raise ValueError(f"RowCache.release: ticket {ticket} was already released")
        raise ValueError(
            f"RowCache.release: unknown ticket {ticket!r} (tickets issued so far: 0..{self._next_ticket - 1})"
        )

    def _release(self, ticket: int, dirty: bool) -> None:
        slots = self._tickets.pop(ticket, None)
        if slots is None:
            self._raise_bad_ticket(ticket)
        self._loaded.pop(ticket, None)
        self._unpin(slots, dirty)
        if not self._tickets and self.size > self.capacity:
            self._shrink()

    def flush(self) -> None:
        """Write every dirty row back to the backing store; the rows stay cached, now clean.

        Rows of a pinned ticket count as dirty only once released with ``dirty=True``.
        """
        with self._locked("flush"):
            self._flush()

    def _flush(self) -> None:
        if self._write_behind is not None:  # the evicted rows first: the file complete after a flush
            self._write_behind.wait()
        slots = self._dirty.nonzero().flatten()
        self._write_back(self.row_of_slot[slots], slots)
        self._dirty[slots] = False
        if self._copies is not None:  # the backing store complete after a flush
            self._copies.land()

    def invalidate(self) -> None:
        """:meth:`flush`, then drop every cached row (after someone wrote the backing store directly).

        Raises RuntimeError while a ticket is pinned (its slots are in use).
        """
        with self._locked("invalidate"):
            self._invalidate()

    def _invalidate(self) -> None:
        if self._tickets:
            raise RuntimeError(
                f"RowCache.invalidate: tickets {sorted(self._tickets)} are still pinned; release them first"
            )
        self._flush()
        self._slot_map.clear(self.row_of_slot)
        self.row_of_slot.fill_(-1)
        self._resident = 0
        self._stamp.zero_()
        self._freq.zero_()
        if self._queue is not None:
            self._queue.clear()

    def resident_rows(self) -> torch.Tensor:
        """The rows cached now, ascending, int64 ``[n]`` on the host (``n <= size``)."""
        with self._locked("resident_rows"):
            return self.row_of_slot[self.row_of_slot >= 0].sort().values.cpu()
