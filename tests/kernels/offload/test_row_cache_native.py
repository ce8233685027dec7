"""The row cache's native bookkeeping ops (csrc/row_cache.cpp) against its pure-torch path: the same slots,
victims, dirty write-backs and counters over randomized acquire / release sequences."""

from __future__ import annotations

import random

import pytest
import torch

from shardkit.kernels.embedding import native_for
from shardkit.kernels.offload.row_cache import RowCache

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


def _same(a: RowCache, b: RowCache) -> None:
    assert torch.equal(a.row_of_slot, b.row_of_slot)
    assert torch.equal(a.slot_of_row, b.slot_of_row)
    assert torch.equal(a._pins, b._pins)
    assert torch.equal(a._dirty, b._dirty)
    assert torch.equal(a._stamp, b._stamp)
    assert torch.equal(a._freq, b._freq)
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name
        assert torch.equal(a.backing[name], b.backing[name]), name
    assert vars(a.counters) == vars(b.counters)


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
        _same(pure, native)
        for _, tn, rows in in_flight:  # rows in flight stay where their ticket put them
            assert torch.equal(native.row_of_slot[native._tickets[tn]], rows)
    for tp, tn, _ in in_flight:
        pure.release(tp, dirty=True)
        native.release(tn, dirty=True)
    pure.flush()
    native.flush()
    _same(pure, native)
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
        NATIVE.row_cache_lookup(slot_of_row, pins, torch.tensor([0, 3]))
    assert pins.tolist() == [0, 0]
    slots, missing = NATIVE.row_cache_lookup(slot_of_row, pins, torch.tensor([2, 1, 0]))
    assert slots.tolist() == [1, -1, 0] and missing.tolist() == [1] and pins.tolist() == [1, 1]
