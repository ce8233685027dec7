"""RowCache.acquire_ids (a step's ids, not its distinct rows) against what it replaces: ``torch.unique``,
``acquire`` of the distinct rows and a gather of their slots. The native passes
(csrc/row_cache_ids.cpp) must leave the cache exactly as that path does (slots, pins, stamps, counts,
victims, write-backs) and remap every id to its row's slot."""

from __future__ import annotations

import random

import pytest
import torch

from shardkit.kernels.embedding import RowOutOfRange, native_for
from shardkit.kernels.offload.row_cache import RowCache
from tests.kernels.offload._cache_state import assert_same_state

NATIVE = native_for(torch.device("cpu"))
needs_native = pytest.mark.skipif(NATIVE is None, reason="native kernels not built (SHARDKIT_NATIVE=0?)")


def _cache(num_rows: int, capacity: int, algorithm: str, use_native: bool, width: int = 3) -> RowCache:
    backing = {
        "weight": torch.arange(num_rows * width, dtype=torch.float32).reshape(num_rows, width),
        "state": torch.zeros(num_rows),
    }
    cache = RowCache(backing, capacity, algorithm)
    cache.use_native = use_native
    return cache


def _by_unique(cache: RowCache, ids: torch.Tensor):
    """What acquire_ids replaces (the lookup's code before it)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    ticket, slots = cache.acquire(unique)
    return ticket, slots.index_select(0, inverse)


@needs_native
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(3))
def test_acquire_ids_equals_unique_then_acquire(algorithm, seed):
    rng = random.Random(seed)
    num_rows, capacity = 300, 40
    # the native passes; the same native cache driven the old way; the pure-torch path
    fused, old, pure = (_cache(num_rows, capacity, algorithm, n) for n in (True, True, False))
    assert fused._native() is not None and pure._native() is None
    in_flight = []
    for step in range(120):
        if in_flight and (len(in_flight) >= 3 or rng.random() < 0.45):
            tickets, slot_ids = in_flight.pop(rng.randrange(len(in_flight)))
            dirty = rng.random() < 0.7
            for cache, ticket in zip((fused, old, pure), tickets):
                slots = cache._tickets[ticket]
                cache.tensors["weight"].index_add_(0, slots, torch.ones(slots.numel(), 3))  # a "kernel"
                cache.tensors["state"].index_add_(0, slots, torch.full((slots.numel(),), 0.5))
                cache.release(ticket, dirty=dirty)
        else:
            count = rng.randrange(0, 80)  # repeats; up to more distinct rows than the capacity: growth
            ids = torch.tensor(
                [min(int(rng.paretovariate(0.7)) - 1, num_rows - 1) for _ in range(count)], dtype=torch.int64
            )
            tf, sf = fused.acquire_ids(ids)
            to, so = _by_unique(old, ids)
            tp, sp = pure.acquire_ids(ids)
            assert torch.equal(sf, so) and torch.equal(sf, sp), step
            assert sf.dtype == torch.int64 and sf.shape == ids.shape
            # every id's slot holds its row
            assert torch.equal(fused.row_of_slot[sf], ids), step
            assert torch.equal(fused._tickets[tf], old._tickets[to])
            in_flight.append(((tf, to, tp), sf))
        assert_same_state(fused, old)
        assert_same_state(fused, pure)
    for tickets, _ in in_flight:
        for cache, ticket in zip((fused, old, pure), tickets):
            cache.release(ticket, dirty=True)
    for cache in (fused, old, pure):
        cache.flush()
    assert_same_state(fused, old)
    assert_same_state(fused, pure)


@needs_native
def test_acquire_ids_runs_no_torch_unique(monkeypatch):
    """The native path deduplicates itself (the point of it): no sort of the ids by torch.unique."""
    cache = _cache(100, 10, "lru", True)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.unique called on the native path")

    monkeypatch.setattr(torch, "unique", refuse)
    ids = torch.tensor([5, 3, 5, 99, 3, 0])
    ticket, slot_ids = cache.acquire_ids(ids)
    assert torch.equal(cache.row_of_slot[slot_ids], ids)
    assert cache.counters.lookups == 4 and cache.counters.misses == 4
    cache.release(ticket, dirty=False)


@needs_native
@pytest.mark.parametrize(
    "num_rows, count",
    [(5000, 6000), ((1 << 22) + 7, 6000), ((1 << 22) + 7, 60000), (100_000, 300), (100_000, 40)],
)
def test_many_distinct_rows_are_sorted_as_unique_sorts_them(num_rows, count):
    """Both ways of deduplicating: a bitmap of the rows (a table of at most 256 rows an id), else a hash
    table and a radix sort of the distinct rows (two passes, three beyond 2^22 rows; a comparison sort
    under 1024 rows)."""
    gen = torch.Generator().manual_seed(num_rows + count)
    ids = torch.randint(0, num_rows, (count,), generator=gen)
    ids = torch.cat([ids, ids[:100], torch.tensor([num_rows - 1, 0])])
    backing = {"weight": torch.zeros(num_rows, 1, dtype=torch.int8)}
    fused, old = RowCache(dict(backing), 8000), RowCache({"weight": backing["weight"].clone()}, 8000)
    for _ in range(2):  # twice: the bitmap / table kept between calls must start empty again
        tf, sf = fused.acquire_ids(ids)
        to, so = _by_unique(old, ids)
        assert torch.equal(sf, so)
        assert torch.equal(fused.slot_of_row, old.slot_of_row)
        assert torch.equal(fused._stamp, old._stamp)
        assert torch.equal(fused.row_of_slot[sf], ids)
        fused.release(tf, dirty=False)
        old.release(to, dirty=False)
        ids = ids.flip(0)[: count // 2]


@pytest.mark.parametrize("use_native", [True, False])
def test_an_id_outside_the_table_is_refused_and_nothing_changes(use_native):
    if use_native and NATIVE is None:
        pytest.skip("native kernels not built")
    cache = _cache(50, 8, "lru", use_native)
    ticket, _ = cache.acquire_ids(torch.tensor([1, 2, 3]))
    before = {n: getattr(cache, n).clone() for n in ("slot_of_row", "row_of_slot", "_pins", "_stamp")}
    for bad in (50, -1):
        with pytest.raises(RowOutOfRange, match=str(bad)):
            cache.acquire_ids(torch.tensor([4, bad, 4]))
    for name, value in before.items():
        assert torch.equal(getattr(cache, name), value), name
    cache.release(ticket, dirty=False)
    assert cache.pinned_tickets == ()


@pytest.mark.parametrize("use_native", [True, False])
def test_empty_ids_and_int32_ids(use_native):
    if use_native and NATIVE is None:
        pytest.skip("native kernels not built")
    cache = _cache(50, 8, "lru", use_native)
    ticket, slot_ids = cache.acquire_ids(torch.zeros(0, dtype=torch.int64))
    assert slot_ids.shape == (0,) and slot_ids.dtype == torch.int64
    cache.release(ticket, dirty=False)
    ids = torch.tensor([7, 7, 1], dtype=torch.int32)
    ticket, slot_ids = cache.acquire_ids(ids)
    assert slot_ids.dtype == torch.int64 and torch.equal(cache.row_of_slot[slot_ids], ids.long())
    cache.release(ticket, dirty=True)
    with pytest.raises(TypeError, match="integer"):
        cache.acquire_ids(torch.tensor([1.0]))


@needs_native
def test_native_lookup_ids_restores_the_slot_map():
    """The slot map marks the rows seen during the pass; every entry is put back."""
    slot_of_row = torch.full((20,), -1, dtype=torch.int32)
    slot_of_row[[2, 5, 9]] = torch.tensor([0, 1, 2], dtype=torch.int32)
    pins = torch.zeros(3, dtype=torch.int32)
    map_before = slot_of_row.clone()
    ids = torch.tensor([9, 4, 9, 2, 4, 17, 2, 2])
    rows, looked, miss_rows, inverse = NATIVE.row_cache_lookup_ids([slot_of_row], 20, pins, ids)
    assert torch.equal(slot_of_row, map_before)
    assert rows.tolist() == [2, 4, 9, 17]
    assert looked.tolist() == [0, -1, 2, -1]
    assert miss_rows.tolist() == [4, 17]
    assert torch.equal(rows[inverse], ids)
    assert pins.tolist() == [1, 0, 1]  # each hit pinned once, however many of its ids
