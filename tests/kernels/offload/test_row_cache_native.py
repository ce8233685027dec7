"""The row cache's native bookkeeping ops (csrc/row_cache.cpp) against its pure-torch path: the same slots,
victims, dirty write-backs and counters over randomized acquire / release sequences."""

from __future__ import annotations

import random

import pytest
import torch

from shardkit.kernels.embedding import native_for
from shardkit.kernels.offload.row_cache import RowCache
from tests.kernels.offload._cache_state import assert_same_state

NATIVE = native_for(torch.device("cpu"))
needs_native = pytest.mark.skipif(NATIVE is None, reason="native kernels not built (SHARDKIT_NATIVE=0?)")


def _pair(num_rows: int, capacity: int, algorithm: str):
    caches = []
    for use_native in (False, True):
        backing = {
            "weight": torch.arange(num_rows * 3, dtype=torch.float32).reshape(num_rows, 3),
            "state": torch.zeros(num_rows),
        }
        cache = RowCache(backing, capacity, algorithm)
        cache.use_native = use_native
        caches.append(cache)
    return caches


@needs_native
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(4))
def test_native_bookkeeping_matches_the_torch_path(algorithm, seed):
    rng = random.Random(seed)
    num_rows, capacity = 200, 24
    pure, native = _pair(num_rows, capacity, algorithm)
    assert pure._native() is None and native._native() is not None
    in_flight = []  # (pure ticket, native ticket, rows): pinned, never evicted
    for step in range(150):
        if in_flight and (len(in_flight) >= 3 or rng.random() < 0.45):
            tp, tn, rows = in_flight.pop(rng.randrange(len(in_flight)))
            dirty = rng.random() < 0.7
            for cache, ticket in ((pure, tp), (native, tn)):
                slots = cache._tickets[ticket].to(cache.device)
                cache.tensors["weight"].index_add_(0, slots, torch.ones(slots.numel(), 3))  # a "kernel"
                cache.tensors["state"].index_add_(0, slots, torch.full((slots.numel(),), 0.5))
                cache.release(ticket, dirty=dirty)
        else:
            count = rng.randrange(0, 30)  # up to more than the capacity: growth, then shrinking
            # skewed draws: hot rows hit, cold ones miss and evict
            rows = sorted({min(int(rng.paretovariate(0.8)) - 1, num_rows - 1) for _ in range(count)})
            rows_t = torch.tensor(rows, dtype=torch.int64)
            if rng.random() < 0.3:
                rows_t = rows_t[torch.randperm(rows_t.numel(), generator=torch.Generator().manual_seed(step))]
            tp, sp = pure.acquire(rows_t)
            tn, sn = native.acquire(rows_t)
            assert torch.equal(sp, sn), step
            in_flight.append((tp, tn, rows_t))
        assert_same_state(pure, native)
        for _, tn, rows in in_flight:  # rows in flight stay where their ticket put them
            assert torch.equal(native.row_of_slot[native._tickets[tn]], rows)
    for tp, tn, _ in in_flight:
        pure.release(tp, dirty=True)
        native.release(tn, dirty=True)
    pure.flush()
    native.flush()
    assert_same_state(pure, native)
    assert native.counters.evictions > 0  # the sequence did put the cache under pressure


@needs_native
@pytest.mark.parametrize("lfu", [False, True])
def test_native_victims_are_the_torch_choice(lfu):
    gen = torch.Generator().manual_seed(3)
    size = 500
    cache = RowCache({"w": torch.zeros(size, 1)}, size, "lfu" if lfu else "lru")
    cache._stamp.copy_(torch.randperm(size, generator=gen) + 1)  # distinct, as acquires leave them
    cache._freq.copy_(torch.randint(0, 4, (size,), generator=gen))  # many ties: broken by the stamps
    candidates = torch.randperm(size, generator=gen)[:300].sort().values
    for count in (0, 1, 7, 150, 299, 300, 400):
        cache.use_native = False
        expected = cache._victims(candidates, count).sort().values
        cache.use_native = True
        got = cache._victims(candidates, count)
        assert torch.equal(got, expected), count


@needs_native
def test_native_lookup_rejects_a_row_outside_the_table_without_pinning():
    slot_of_row = torch.tensor([0, -1, 1], dtype=torch.int32)
    pins = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside"):
        NATIVE.row_cache_lookup([slot_of_row], 3, pins, torch.tensor([0, 3]))
    assert pins.tolist() == [0, 0]
    slots, missing = NATIVE.row_cache_lookup([slot_of_row], 3, pins, torch.tensor([2, 1, 0]))
    assert slots.tolist() == [1, -1, 0] and missing.tolist() == [1] and pins.tolist() == [1, 1]


def _zipf_rows(rng: random.Random, num_rows: int, count: int) -> torch.Tensor:
    # skewed (the square of a uniform draw): hot rows hit, the others miss and evict
    return torch.tensor(sorted({int(num_rows * rng.random() ** 2) for _ in range(count)}))


@needs_native
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_native_steady_state_evicts_from_the_queue_without_a_full_selection(algorithm, monkeypatch):
    """In the steady state (a full cache, nothing pinned beyond the batch) the native path takes LRU and
    LFU victims from its replacement queue: the selection over every evictable slot (row_cache_victims,
    a pass over the whole cache) never runs, and the victims are still the torch path's."""
    selections = [0]
    victims = RowCache._victims

    def counted(self, candidates, count):
        if self.use_native:
            selections[0] += 1
        return victims(self, candidates, count)

    monkeypatch.setattr(RowCache, "_victims", counted)
    rng = random.Random(7)
    pure, native = _pair(400, 40, algorithm)
    for _ in range(60):
        rows = _zipf_rows(rng, 400, 30)
        for cache in (pure, native):
            ticket, _ = cache.acquire(rows)
            cache.release(ticket, dirty=True)
        assert_same_state(pure, native)
    assert native.counters.evictions > 200, native.counters
    assert selections[0] == 0


@needs_native
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_switching_paths_between_acquires_keeps_the_choices(algorithm):
    """use_native may change between acquires (kernel_backend("torch") around some steps): the path's
    replacement queue is rebuilt from the stamps, and the victims stay those of a cache that never
    switched."""
    rng = random.Random(11)
    pure, native = _pair(300, 25, algorithm)
    for step in range(80):
        native.use_native = step % 7 < 4  # runs of each path
        rows = _zipf_rows(rng, 300, 20)
        held = []
        for cache in (pure, native):
            ticket, _ = cache.acquire(rows)
            held.append(ticket)
        if step % 3 == 0:  # a second batch while the first is pinned: evictions skip pinned slots
            extra = _zipf_rows(rng, 300, 12)
            for cache in (pure, native):
                ticket, _ = cache.acquire(extra)
                cache.release(ticket, dirty=False)
        for cache, ticket in zip((pure, native), held):
            cache.release(ticket, dirty=True)
        assert_same_state(pure, native)
    assert native.counters.evictions > 100, native.counters


@needs_native
@pytest.mark.parametrize("lfu", [False, True])
def test_native_slot_queue_takes_the_full_selections_victims(lfu):
    """The native SlotQueue against select_victims on random stamps / counts / pins: rebuilt from the
    state, then its take() == the full selection over the unpinned resident slots; a take asking for
    more than is evictable reports that it ran out."""
    from shardkit.kernels.offload.slot_queue import NativeSlotQueue
    from shardkit.kernels.offload.victims import select_victims

    gen = torch.Generator().manual_seed(5)
    for trial in range(20):
        size = 200
        row_of_slot = torch.where(torch.rand(size, generator=gen) < 0.8, torch.arange(size), -1)
        stamp = (torch.randperm(size, generator=gen) + 1) * (row_of_slot >= 0)
        freq = torch.randint(1, 4, (size,), generator=gen) * (row_of_slot >= 0)
        pins = (torch.rand(size, generator=gen) < 0.2).to(torch.int32)
        evictable = ((row_of_slot >= 0) & (pins == 0)).nonzero().flatten()
        queue = NativeSlotQueue(lfu)
        queue.rebuild(row_of_slot, stamp, freq)
        assert queue.entries == int((row_of_slot >= 0).sum())
        count = 1 + trial * 5
        got = queue.take(count, stamp, pins)
        expected = select_victims(evictable, stamp, freq, count, lfu).sort().values
        assert torch.equal(got, expected), trial
        assert queue.entries == int((row_of_slot >= 0).sum()) - count  # pinned entries kept
        assert queue.take(evictable.numel() - count + 1, stamp, pins) is None
