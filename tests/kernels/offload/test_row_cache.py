"""RowCache (kernels/offload/row_cache.py): the fast tier in front of a backing store of rows.

The main test drives the cache and a plain-Python model of it with the same random sequences of
acquire / in-place update / release (dirty or clean) / flush / invalidate, at capacities 0, 1, small and
larger than the table, with both algorithms, and checks after every operation: the rows resident, the
allocated size, every counter, the acquired slots' content (== a reference table that received the same
updates directly) and, after a flush with nothing pinned, the backing store == that reference, bitwise.
Hand-made sequences pin down the LRU / LFU victims, pinning under eviction pressure, growth, the exact
counters, and the errors. The CUDA variant (cache on the device, backing on the host) is marked ``cuda``.
"""

from __future__ import annotations

import random
from typing import Dict, List

import pytest
import torch

from shardkit.kernels import kernel_backend
from shardkit.kernels.embedding import RowOutOfRange, native_for
from shardkit.kernels.offload.cache_counters import CacheCounters
from shardkit.kernels.offload.row_cache import RowCache

ROW_BYTES = 4 * 4 + 4 + 3  # weight float32 [4] + state float32 [] + codes uint8 [3]
COUNTS = ["lookups", "hits", "misses", "evictions", "rows_read", "rows_written", "bytes_read"]
COUNTS += ["bytes_written"]

BACKENDS = ["torch"] + (["native"] if native_for(torch.device("cpu")) is not None else [])


@pytest.fixture(autouse=True, params=BACKENDS)
def backend(request):
    """Every test on both bookkeeping paths: the native ops and queue (csrc/row_cache*.cpp) where built,
    and the pure-torch path (``kernel_backend("torch")``, as ``SHARDKIT_NATIVE=0``)."""
    if request.param == "torch":
        with kernel_backend("torch"):
            yield request.param
    else:
        yield request.param


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (tools/device_check.sh runs these)"
)


def _backing(num_rows: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Three fields of different dtypes and widths: weight f32 [R, 4], state f32 [R], codes u8 [R, 3]."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(num_rows, 4, generator=gen),
        "state": torch.rand(num_rows, generator=gen),
        "codes": torch.randint(0, 256, (num_rows, 3), generator=gen, dtype=torch.uint8),
    }


def _clone(fields: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in fields.items()}


def _assert_fields_equal(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str):
    for name in expected:
        assert torch.equal(actual[name].cpu(), expected[name].cpu()), f"{what}: field {name!r} differs"


class ModelCache:
    """The specified behaviour in plain Python: which rows are resident, the size, the counters."""

    def __init__(self, capacity: int, algorithm: str, num_rows: int) -> None:
        self.capacity = min(capacity, num_rows)
        self.size = self.capacity
        self.algorithm = algorithm
        self.rows: Dict[int, dict] = {}  # row -> stamp, freq, pins, dirty
        self.clock = 0
        self.tickets: Dict[int, List[int]] = {}
        self.next_ticket = 0
        self.counts = dict.fromkeys(COUNTS, 0)

    def _order(self, candidates: List[int]) -> List[int]:
        if self.algorithm == "lru":
            return sorted(candidates, key=lambda r: self.rows[r]["stamp"])
        return sorted(candidates, key=lambda r: (self.rows[r]["freq"], self.rows[r]["stamp"]))

    def _write(self, count: int) -> None:
        self.counts["rows_written"] += count
        self.counts["bytes_written"] += count * ROW_BYTES

    def _evict(self, victims: List[int]) -> None:
        self._write(sum(self.rows[r]["dirty"] for r in victims))
        for r in victims:
            del self.rows[r]
        self.counts["evictions"] += len(victims)

    def acquire(self, rows: List[int]) -> int:
        hits = [r for r in rows if r in self.rows]
        misses = [r for r in rows if r not in self.rows]
        for r in hits:
            self.rows[r]["pins"] += 1
        free = self.size - len(self.rows)
        if len(misses) > free:
            needed = len(misses) - free
            evictable = [r for r, s in self.rows.items() if s["pins"] == 0]
            if len(evictable) < needed:
                self.size += needed - len(evictable)
                self._evict(evictable)
            else:
                self._evict(self._order(evictable)[:needed])
        for r in misses:
            self.rows[r] = {"stamp": 0, "freq": 0, "pins": 1, "dirty": False}
        for i, r in enumerate(rows):
            self.rows[r]["stamp"] = self.clock + i
            self.rows[r]["freq"] += 1
        self.clock += len(rows)
        self.counts["lookups"] += len(rows)
        self.counts["hits"] += len(hits)
        self.counts["misses"] += len(misses)
        self.counts["rows_read"] += len(misses)
        self.counts["bytes_read"] += len(misses) * ROW_BYTES
        ticket = self.next_ticket
        self.next_ticket += 1
        self.tickets[ticket] = list(rows)
        return ticket

    def release(self, ticket: int, dirty: bool) -> None:
        for r in self.tickets.pop(ticket):
            self.rows[r]["pins"] -= 1
            self.rows[r]["dirty"] |= dirty
        if not self.tickets and self.size > self.capacity:
            self._evict(self._order(list(self.rows))[: max(len(self.rows) - self.capacity, 0)])
            self.size = self.capacity

    def flush(self) -> None:
        dirty = [r for r, s in self.rows.items() if s["dirty"]]
        self._write(len(dirty))
        for r in dirty:
            self.rows[r]["dirty"] = False

    def invalidate(self) -> None:
        self.flush()
        self.rows.clear()


def _check_against_model(cache: RowCache, model: ModelCache, step: str) -> None:
    assert cache.resident_rows().tolist() == sorted(model.rows), f"{step}: resident rows"
    assert cache.size == model.size, f"{step}: size {cache.size} != {model.size}"
    assert all(t.shape[0] == model.size for t in cache.tensors.values()), f"{step}: buffer sizes"
    counts = cache.counters.as_dict()
    for name, expected in model.counts.items():
        assert counts[name] == expected, f"{step}: counter {name} = {counts[name]}, expected {expected}"
    # the host slot map is the inverse of row_of_slot
    resident = cache.resident_rows()
    slots = cache.slot_of_row.cpu()[resident].long()  # on the device under the device bookkeeping
    assert torch.equal(cache.row_of_slot.cpu()[slots], resident), f"{step}: slot map"
    assert int((cache.slot_of_row >= 0).sum()) == resident.numel(), f"{step}: stale slot map entries"


def _update(cache: RowCache, slots: torch.Tensor, rows: torch.Tensor, reference, gen: torch.Generator):
    """The same in-place update of the slots' rows in the cache and of the rows in the reference."""
    delta = torch.randn(rows.numel(), 4, generator=gen)
    step = torch.rand(rows.numel(), generator=gen)
    cache.tensors["weight"][slots] += delta.to(slots.device)
    reference["weight"][rows] += delta
    cache.tensors["state"][slots] += step.to(slots.device)
    reference["state"][rows] += step
    cache.tensors["codes"][slots] += 7  # uint8 wraps around the same way in both
    reference["codes"][rows] += 7


def _run_random_sequence(
    capacity: int, algorithm: str, seed: int, device: str, steps: int, bookkeeping=None
) -> None:
    """``bookkeeping``: RowCache's argument (None: its default; test_row_cache_device.py passes "device")."""
    num_rows = 24
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    backing = _backing(num_rows, seed)
    if bookkeeping == "device" and device == "cuda":  # it gathers and scatters pinned memory (zero-copy)
        backing = {name: t.pin_memory() for name, t in backing.items()}
    reference = _clone(backing)
    cache = RowCache(backing, capacity, algorithm=algorithm, device=device, bookkeeping=bookkeeping)
    if bookkeeping is not None:
        assert cache.bookkeeping == bookkeeping
    model = ModelCache(capacity, algorithm, num_rows)
    weights = [1.0 / (r + 1) for r in range(num_rows)]  # skewed: hot rows give hits, cold ones misses
    outstanding: Dict[int, tuple] = {}  # ticket -> (rows, dirty)
    counts = dict.fromkeys(["acquire", "release", "flush", "invalidate", "grew"], 0)
    for i in range(steps):
        choice = rng.random()
        step = f"step {i} (capacity {capacity}, {algorithm}, seed {seed})"
        if choice < 0.45 and len(outstanding) < 3:
            size = rng.choice([0, 1, 2, 3, 5, 8])
            picked: List[int] = []
            while len(picked) < size:
                r = rng.choices(range(num_rows), weights)[0]
                if r not in picked:
                    picked.append(r)
            rows = torch.tensor(picked, dtype=torch.int64)
            size_before = cache.size
            ticket, slots = cache.acquire(rows)
            counts["grew"] += cache.size > size_before
            assert ticket == model.acquire(picked), step
            assert slots.device.type == torch.device(device).type and slots.dtype == torch.int64
            got = {name: t.index_select(0, slots).cpu() for name, t in cache.tensors.items()}
            want = {name: t.index_select(0, rows) for name, t in reference.items()}
            _assert_fields_equal(got, want, f"{step}: acquired rows' content")
            dirty = rng.random() < 0.6
            if dirty:
                _update(cache, slots, rows, reference, gen)
            outstanding[ticket] = (rows, dirty)
            counts["acquire"] += 1
        elif choice < 0.8 and outstanding:
            ticket = rng.choice(sorted(outstanding))
            _, dirty = outstanding.pop(ticket)
            cache.release(ticket, dirty=dirty)
            model.release(ticket, dirty)
            counts["release"] += 1
        elif choice < 0.92:
            cache.flush()
            model.flush()
            if not outstanding:
                _assert_fields_equal(backing, reference, f"{step}: backing after flush")
            counts["flush"] += 1
        elif outstanding:
            with pytest.raises(RuntimeError, match="still pinned"):
                cache.invalidate()
        else:
            cache.invalidate()
            model.invalidate()
            _assert_fields_equal(backing, reference, f"{step}: backing after invalidate")
            counts["invalidate"] += 1
        _check_against_model(cache, model, step)
        assert cache._resident == int((cache.row_of_slot >= 0).sum()), step
    for ticket, (_, dirty) in sorted(outstanding.items()):
        cache.release(ticket, dirty=dirty)
        model.release(ticket, dirty)
    cache.flush()
    model.flush()
    _check_against_model(cache, model, "end")
    _assert_fields_equal(backing, reference, "backing at the end")
    # the sequence exercised what it claims to
    assert counts["acquire"] > 20 and counts["release"] > 20 and counts["flush"] > 3, counts
    assert cache.counters.hits > 0 and cache.counters.misses > 0
    if 0 < capacity < 8:
        assert cache.counters.evictions > 0 and counts["grew"] > 0, counts


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
@pytest.mark.parametrize("capacity", [0, 1, 4, 10, 40])
def test_random_sequences_match_the_model_and_a_reference_table(capacity, algorithm):
    for seed in range(3):
        _run_random_sequence(capacity, algorithm, seed, "cpu", steps=160)


@pytest.mark.parametrize("capacity", [1, 4, 10])
def test_lru_queue_rebuilt_often_still_matches_the_model(capacity, monkeypatch):
    # the LRU victims come from a recency queue rebuilt from the stamps when it grows: rebuild it after
    # a few acquires, so that the sequences cross many rebuilds (and shrinks, which rebuild it too)
    monkeypatch.setattr(RowCache, "QUEUE_REBUILD_MIN_ENTRIES", 2)
    rebuilds = [0]
    rebuild = RowCache._rebuild_queue

    def counted(self):
        rebuilds[0] += 1
        rebuild(self)

    monkeypatch.setattr(RowCache, "_rebuild_queue", counted)
    for seed in range(3, 6):
        for algorithm in ("lru", "lfu"):
            _run_random_sequence(capacity, algorithm, seed, "cpu", steps=300)
    assert rebuilds[0] > 10, rebuilds


@pytest.mark.parametrize("bookkeeping", ["host", "device"])
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
@pytest.mark.parametrize("capacity", [0, 4, 40])
@pytest.mark.cuda
@needs_cuda
def test_random_sequences_on_cuda(capacity, algorithm, bookkeeping):
    _run_random_sequence(capacity, algorithm, 0, "cuda", steps=160, bookkeeping=bookkeeping)


def _acquire_release(cache: RowCache, rows: List[int], dirty: bool = False) -> torch.Tensor:
    ticket, slots = cache.acquire(torch.tensor(rows, dtype=torch.int64))
    cache.release(ticket, dirty=dirty)
    return slots


def test_lru_evicts_the_least_recently_acquired():
    cache = RowCache(_backing(10), 3, algorithm="lru")
    _acquire_release(cache, [0, 1, 2])
    _acquire_release(cache, [0])  # recency now 1 < 2 < 0
    _acquire_release(cache, [5])
    assert cache.resident_rows().tolist() == [0, 2, 5]
    _acquire_release(cache, [6, 7])  # 2 and 0 are the two least recent
    assert cache.resident_rows().tolist() == [5, 6, 7]
    # within one acquire, earlier positions count as less recent: 8 evicts 5 (oldest), then 9 evicts 6
    _acquire_release(cache, [8])
    _acquire_release(cache, [9])
    assert cache.resident_rows().tolist() == [7, 8, 9]


def test_lru_choice_when_the_recency_queue_runs_out():
    """The LRU queue is the fast path; when it runs out with enough evictable slots (a row left
    resident without a queue entry, simulated by dropping the queue) the choice is still the least
    recent, and the queue is whole again for the next eviction; with too few evictable slots the cache
    grows instead."""
    cache = RowCache(_backing(10), 3, algorithm="lru")
    _acquire_release(cache, [0, 1, 2])
    _acquire_release(cache, [0])  # recency now 1 < 2 < 0
    cache._queue.clear()
    _acquire_release(cache, [5])
    assert cache.resident_rows().tolist() == [0, 2, 5]
    assert cache._queue.entries == 3
    _acquire_release(cache, [6])  # from the rebuilt queue: 2 is the least recent
    assert cache.resident_rows().tolist() == [0, 5, 6]
    ticket, _ = cache.acquire(torch.tensor([0, 5]))  # pinned: only 6 is evictable
    _acquire_release(cache, [7, 8])  # needs two slots: grows by one, evicting 6
    assert cache.resident_rows().tolist() == [0, 5, 7, 8]
    cache.release(ticket, dirty=False)
    assert cache.size == 3 and cache.resident_rows().numel() == 3


def test_lfu_evicts_the_least_frequently_acquired_ties_by_lru():
    lfu = RowCache(_backing(10), 3, algorithm="lfu")
    lru = RowCache(_backing(10), 3, algorithm="lru")
    for cache in (lfu, lru):
        _acquire_release(cache, [0, 1, 2])
        _acquire_release(cache, [0, 1])
        _acquire_release(cache, [2])  # acquisitions: 0 -> 2, 1 -> 2, 2 -> 2; recency 0 < 1 < 2
        _acquire_release(cache, [0])  # 0 -> 3
        _acquire_release(cache, [5])
    # lfu: 1 and 2 tie at 2 acquisitions, 1 is less recent; lru: 1 is the least recent too
    assert lfu.resident_rows().tolist() == [0, 2, 5]
    assert lru.resident_rows().tolist() == [0, 2, 5]
    _acquire_release(lfu, [6])
    _acquire_release(lru, [6])
    # lfu drops 5 (1 acquisition, the most recent row); lru drops 2 (least recent)
    assert lfu.resident_rows().tolist() == [0, 2, 6]
    assert lru.resident_rows().tolist() == [0, 5, 6]
    # the count restarts when a row is reloaded: 5 comes back with 1 acquisition and goes first
    _acquire_release(lfu, [5])  # evicts 6 (1 acquisition)
    _acquire_release(lfu, [7])  # evicts 5 (1 acquisition), not 2 (2) nor 0 (3)
    assert lfu.resident_rows().tolist() == [0, 2, 7]


def test_pinned_rows_survive_eviction_pressure():
    backing = _backing(30)
    reference = _clone(backing)
    for algorithm in ("lru", "lfu"):
        cache = RowCache(backing, 4, algorithm=algorithm)
        held, held_slots = cache.acquire(torch.tensor([0, 1]))
        for start in range(2, 20, 2):  # a stream of other batches, 2 free slots for them
            _acquire_release(cache, [start, start + 1])
            assert {0, 1} <= set(cache.resident_rows().tolist()), f"{algorithm}: a pinned row was evicted"
        assert cache.size == 4, "two unpinned slots sufficed: no growth"
        assert cache.slot_of_row[[0, 1]].long().tolist() == held_slots.tolist()
        _assert_fields_equal(
            {n: t[held_slots] for n, t in cache.tensors.items()},
            {n: t[[0, 1]] for n, t in reference.items()},
            f"{algorithm}: pinned rows' content",
        )
        assert cache.counters.evictions == 16
        cache.release(held, dirty=False)
        _acquire_release(cache, [20, 21, 22, 23])  # now 0 and 1 may go
        assert cache.resident_rows().tolist() == [20, 21, 22, 23]


def test_growth_keeps_old_slots_valid_and_shrinks_back():
    backing = _backing(12)
    reference = _clone(backing)
    cache = RowCache(backing, 2)
    first, first_slots = cache.acquire(torch.tensor([3, 4]))
    version = cache.buffers_version
    second, second_slots = cache.acquire(torch.tensor([5, 6, 7]))
    assert cache.size == 5 and cache.buffers_version == version + 1
    assert cache.resident_rows().tolist() == [3, 4, 5, 6, 7]
    assert cache.slot_of_row[[3, 4]].long().tolist() == first_slots.tolist()
    assert set(second_slots.tolist()).isdisjoint(first_slots.tolist())
    # the first batch's rows are intact in the grown buffers, and updating them there is kept
    _assert_fields_equal(
        {n: t[first_slots] for n, t in cache.tensors.items()},
        {n: t[[3, 4]] for n, t in reference.items()},
        "first ticket's rows after growth",
    )
    cache.tensors["weight"][first_slots] += 1.0
    reference["weight"][[3, 4]] += 1.0
    cache.release(first, dirty=True)
    assert cache.size == 5, "a ticket is still pinned: no shrink yet"
    cache.release(second, dirty=False)
    # back to capacity 2: the least recent rows (3, 4: dirty, written back; 5) go
    assert cache.size == 2 and all(t.shape[0] == 2 for t in cache.tensors.values())
    assert cache.resident_rows().tolist() == [6, 7]
    assert cache.counters.evictions == 3 and cache.counters.rows_written == 2
    _assert_fields_equal(backing, reference, "backing after the shrink")
    slots = _acquire_release(cache, [6, 7])
    assert cache.counters.hits == 2
    _assert_fields_equal(
        {n: t[slots] for n, t in cache.tensors.items()},
        {n: t[[6, 7]] for n, t in reference.items()},
        "compacted rows",
    )


def test_capacity_zero_holds_only_the_working_set():
    backing = _backing(8)
    reference = _clone(backing)
    cache = RowCache(backing, 0)
    assert all(t.shape[0] == 0 for t in cache.tensors.values())
    ticket, slots = cache.acquire(torch.tensor([6, 1]))
    assert cache.size == 2
    cache.tensors["state"][slots] -= 3.0
    reference["state"][[6, 1]] -= 3.0
    cache.release(ticket, dirty=True)
    assert cache.size == 0 and cache.resident_rows().numel() == 0
    _assert_fields_equal(backing, reference, "written back at release")
    assert cache.counters.rows_written == 2 and cache.counters.evictions == 2


def test_counters_are_exact():
    cache = RowCache(_backing(10), 2)
    _acquire_release(cache, [0, 1], dirty=True)  # 2 misses
    _acquire_release(cache, [1, 2])  # hit 1; miss 2 evicts 0 (dirty: written back)
    cache.flush()  # writes row 1
    cache.flush()  # nothing dirty any more
    _acquire_release(cache, [3])  # evicts 1 (clean now)
    _acquire_release(cache, [])  # an empty request counts nothing
    expected = {
        "lookups": 5,
        "hits": 1,
        "misses": 4,
        "evictions": 2,
        "rows_read": 4,
        "rows_written": 2,
        "bytes_read": 4 * ROW_BYTES,
        "bytes_written": 2 * ROW_BYTES,
        "hit_rate": 0.2,
    }
    assert cache.row_bytes == ROW_BYTES
    assert cache.counters.as_dict() == expected
    assert cache.counters.hit_rate == pytest.approx(0.2)
    cache.counters.reset()
    assert cache.counters == CacheCounters() and cache.counters.hit_rate == 0.0


def test_flush_keeps_rows_and_invalidate_rereads_the_backing():
    backing = _backing(6)
    cache = RowCache(backing, 4)
    ticket, slots = cache.acquire(torch.tensor([2, 3]))
    cache.tensors["weight"][slots] = 5.0
    cache.release(ticket, dirty=True)
    cache.flush()
    assert cache.resident_rows().tolist() == [2, 3]
    assert torch.equal(backing["weight"][[2, 3]], torch.full((2, 4), 5.0))
    backing["weight"][2] = -1.0  # someone writes the backing directly
    cache.invalidate()
    assert cache.resident_rows().numel() == 0
    assert cache.counters.rows_written == 2, "clean rows are not written again"
    ticket, slots = cache.acquire(torch.tensor([2]))
    assert torch.equal(cache.tensors["weight"][slots], torch.full((1, 4), -1.0))
    cache.release(ticket, dirty=False)


def test_rows_of_other_integer_dtypes_and_empty_requests():
    cache = RowCache(_backing(5), 2)
    ticket, slots = cache.acquire(torch.tensor([4, 0], dtype=torch.int32))
    assert slots.dtype == torch.int64 and cache.slot_of_row[[4, 0]].long().tolist() == slots.tolist()
    cache.release(ticket, dirty=False)
    ticket, slots = cache.acquire(torch.empty(0, dtype=torch.int64))
    assert slots.shape == (0,) and cache.pinned_tickets == (ticket,)
    cache.release(ticket, dirty=True)
    assert cache.counters.lookups == 2 and cache.counters.rows_written == 0


def test_errors():
    cache = RowCache(_backing(5), 2)
    with pytest.raises(RowOutOfRange, match=r"position 1 maps to buffer row 5, outside \[0, 5\)"):
        cache.acquire(torch.tensor([0, 5]))
    with pytest.raises(RowOutOfRange, match="row -1"):
        cache.acquire(torch.tensor([-1]))
    with pytest.raises(ValueError, match="row 3 appears more than once"):
        cache.acquire(torch.tensor([3, 1, 3]))
    with pytest.raises(TypeError, match="integer tensor"):
        cache.acquire(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="integer tensor"):
        cache.acquire([1, 2])
    with pytest.raises(ValueError, match="1-D"):
        cache.acquire(torch.tensor([[1, 2]]))
    # the failed requests left nothing pinned or loaded
    assert cache.pinned_tickets == () and cache.resident_rows().numel() == 0
    assert cache.counters == CacheCounters()
    ticket, _ = cache.acquire(torch.tensor([1]))
    with pytest.raises(RuntimeError, match=rf"tickets \[{ticket}\] are still pinned"):
        cache.invalidate()
    with pytest.raises(ValueError, match="unknown ticket 7"):
        cache.release(7, dirty=False)
    cache.release(ticket, dirty=False)
    with pytest.raises(ValueError, match=f"ticket {ticket} was already released"):
        cache.release(ticket, dirty=False)
    cache.invalidate()
    with pytest.raises(ValueError, match="capacity must be an int >= 0"):
        RowCache(_backing(5), -1)
    with pytest.raises(ValueError, match="unknown cache algorithm 'fifo'"):
        RowCache(_backing(5), 1, algorithm="fifo")
    with pytest.raises(ValueError, match="'b' has 3"):
        RowCache({"a": torch.zeros(4, 2), "b": torch.zeros(3)}, 1)
    with pytest.raises(ValueError, match="non-empty dict"):
        RowCache({}, 1)


def test_capacity_above_the_table_is_clamped_and_enum_algorithms_are_accepted():
    class Algorithm:  # like torchrec's CacheAlgorithm.LFU: an enum member named after the algorithm
        name = "LFU"

    cache = RowCache(_backing(3), 10, algorithm=Algorithm())
    assert cache.capacity == 3 and cache.algorithm == "lfu" and cache.size == 3


@pytest.mark.cuda
@needs_cuda
def test_cuda_cache_over_pinned_host_backing():
    backing = {name: t.pin_memory() for name, t in _backing(16).items()}
    reference = _clone(backing)
    cache = RowCache(backing, 3, device="cuda")
    assert all(t.is_cuda for t in cache.tensors.values())
    ticket, slots = cache.acquire(torch.tensor([9, 2, 5, 11], device="cuda"))  # grows to 4
    assert slots.is_cuda and cache.size == 4
    _update(cache, slots, torch.tensor([9, 2, 5, 11]), reference, torch.Generator().manual_seed(1))
    cache.release(ticket, dirty=True)  # shrinks to 3: row 9 written back
    assert backing["weight"].device.type == "cpu" and cache.counters.rows_written == 1
    cache.flush()
    _assert_fields_equal(backing, reference, "pinned backing after flush")


def test_io_in_chunks_moves_the_same_rows_and_calls_after_io_per_chunk():
    """io_chunk_rows: misses read and victims written back a chunk at a time, ``after_io`` after each
    (how a mapped file's pages are unmapped between chunks); the data moved is the same as unchunked."""
    backing, plain_backing = _backing(20), _backing(20)
    calls = []
    cache = RowCache(backing, 3, io_chunk_rows=2, after_io=lambda: calls.append(1))
    plain = RowCache(plain_backing, 3)
    for rows in ([5, 1, 7, 9, 0], [2, 3, 4, 11, 12, 13, 14]):
        for c in (cache, plain):
            ticket, slots = c.acquire(torch.tensor(rows))
            c.tensors["weight"][slots] += 1.0
            c.release(ticket, dirty=True)
    # first request: 5 rows read (3 chunks), its shrink writes 2 back (1 chunk); second: the 3 cached
    # (dirty) rows written back to make room (2 chunks), 7 rows read (4 chunks), its shrink writes 4 (2)
    assert len(calls) == 3 + 1 + 2 + 4 + 2
    assert cache.counters.as_dict() == plain.counters.as_dict()
    cache.flush()
    plain.flush()
    _assert_fields_equal(backing, plain_backing, "chunked vs unchunked write-back")
    with pytest.raises(ValueError, match="io_chunk_rows"):
        RowCache(_backing(4), 2, io_chunk_rows=0)


class _FailingWriteIO:
    """A row_io over in-memory tensors whose next write fails once ``armed``."""

    def __init__(self, backing: Dict[str, torch.Tensor]) -> None:
        self.backing, self.armed = backing, False

    def read_into(self, rows, buffers, slots) -> None:
        for name, store in self.backing.items():
            buffers[name].index_copy_(0, slots, store.index_select(0, rows))

    def write_from(self, rows, buffers, slots) -> None:
        if self.armed:
            self.armed = False
            raise OSError(28, "No space left on device")
        for name, store in self.backing.items():
            store.index_copy_(0, rows, buffers[name].index_select(0, slots))


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_a_failed_eviction_leaves_its_victims_first_in_line(algorithm):
    """An acquire whose victim's write-back fails leaves the victim resident and dirty; the next eviction
    still takes the least recent (LFU: least frequent) row, as if the failed acquire never ran. Before,
    the replacement queue had lost the failed victim's entry: the next eviction took another row and the
    failed victim stayed until the queue ran out."""
    backing = _backing(10)
    io = _FailingWriteIO(backing)
    cache = RowCache(backing, 3, algorithm=algorithm, row_io=io)
    _acquire_release(cache, [0, 1, 2], dirty=True)
    _acquire_release(cache, [1, 2], dirty=True)  # recency 0 < 1 < 2; counts 0 -> 1, 1 -> 2, 2 -> 2
    io.armed = True
    with pytest.raises(OSError, match="No space left"):
        cache.acquire(torch.tensor([5]))  # victim 0: its write-back fails
    assert cache.resident_rows().tolist() == [0, 1, 2] and cache.pinned_tickets == ()
    _acquire_release(cache, [6])
    assert cache.resident_rows().tolist() == [1, 2, 6]  # 0 went first, written back this time
    assert cache.counters.evictions == 1 and cache.counters.rows_written == 1  # the failed write not counted
