"""The row cache's slot map (kernels/offload/slot_map.py, csrc/slot_map.h): the hashed map against the dense
one and a dict, on the torch path and through the native ops (each reading what the other wrote), a row
cache with either map giving the same slots, victims and results, the choice rule and its switch, and the
resident bookkeeping of a hashed cache not growing with the table's rows."""

from __future__ import annotations

import random

import pytest
import torch

from shardkit.kernels.embedding import native_for
from shardkit.kernels.offload.row_cache import RowCache
from shardkit.kernels.offload.slot_map import (
    SLOT_MAP_ENV,
    DenseSlotMap,
    HashSlotMap,
    choose_slot_map,
    hash_entries,
)
from tests.kernels.offload._cache_state import assert_same_state

NATIVE = native_for(torch.device("cpu"))
needs_native = pytest.mark.skipif(NATIVE is None, reason="native kernels not built (SHARDKIT_NATIVE=0?)")


def _rows(rng: random.Random, pool, count: int) -> torch.Tensor:
    # clustered and scattered rows, some huge (the hash of rows near 2^40 must agree on both paths)
    return torch.tensor(rng.sample(sorted(pool), min(count, len(pool))), dtype=torch.int64)


def _check(hashed: HashSlotMap, truth: dict, num_rows: int) -> None:
    probe = torch.tensor(sorted(truth) + [0, 1, 2, num_rows - 1], dtype=torch.int64).unique()
    expected = torch.tensor([truth.get(int(r), -1) for r in probe], dtype=torch.int64)
    assert torch.equal(hashed.get(probe), expected)
    used = hashed.keys >= 0
    assert int(used.sum()) == len(truth)  # no stale entries (no tombstones either)
    assert int(used.sum()) * 2 <= hashed.keys.numel()  # load <= 0.5


@pytest.mark.parametrize("seed", range(3))
def test_hashed_map_matches_a_dict_on_the_torch_path(seed):
    rng = random.Random(seed)
    num_rows = 2**40 if seed == 2 else 5000
    size = 300
    hashed, truth = HashSlotMap(num_rows, size), {}
    free = list(range(size))
    # few distinct homes: long runs, many collisions within a round and backward shifts across them
    pool = {rng.randrange(num_rows) for _ in range(2000)} | set(range(64))
    for _ in range(60):
        if truth and rng.random() < 0.45:
            gone = rng.sample(sorted(truth), rng.randrange(1, len(truth) + 1))
            hashed.erase(torch.tensor(gone, dtype=torch.int64))
            for r in gone:
                free.append(truth.pop(r))
        else:
            new = [r for r in _rows(rng, pool, rng.randrange(1, 120)).tolist() if r not in truth]
            new = new[: len(free)]
            slots = [free.pop(rng.randrange(len(free))) for _ in new]
            hashed.put(torch.tensor(new, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64))
            truth.update(zip(new, slots))
        _check(hashed, truth, num_rows)
    if num_rows < 2**31:  # the dense view: the same map
        dense = torch.full((num_rows,), -1, dtype=torch.int32)
        for r, s in truth.items():
            dense[r] = s
        assert torch.equal(hashed.dense(), dense)


@needs_native
@pytest.mark.parametrize("seed", range(3))
def test_native_ops_and_torch_path_share_the_hashed_map(seed):
    """Rows installed and dropped by the native ops and by the torch path in turn, on one hashed map and
    on a dense one: the same lookups (native and torch), whoever wrote the entries."""
    rng = random.Random(seed)
    num_rows, size = (2**36 if seed else 3000), 200
    hashed, dense = HashSlotMap(num_rows, size), DenseSlotMap(min(num_rows, 3000), torch.device("cpu"))
    pool = sorted({rng.randrange(num_rows) for _ in range(1500)})
    remap = {r: i for i, r in enumerate(pool)}  # the dense map's rows (it cannot hold 2^36)
    row_of_slot = torch.full((size,), -1, dtype=torch.int64)
    zeros = {"dirty": torch.zeros(size, dtype=torch.bool), "stamp": torch.zeros(size, dtype=torch.int64)}
    freq, pins = torch.zeros(size, dtype=torch.int64), torch.zeros(size, dtype=torch.int32)
    dense_row_of_slot = row_of_slot.clone()
    for step in range(40):
        use_native = step % 2 == 0
        resident = (row_of_slot >= 0).nonzero().flatten()
        if resident.numel() and rng.random() < 0.4:
            victims = resident[torch.randperm(resident.numel())[: rng.randrange(1, resident.numel() + 1)]]
            victims = victims.sort().values
            rows = row_of_slot[victims]
            if use_native:
                NATIVE.row_cache_drop(victims, hashed.tensors, num_rows, row_of_slot, *zeros.values(), freq)
            else:
                hashed.erase(rows)
                row_of_slot[victims] = -1
            dense.erase(torch.tensor([remap[int(r)] for r in rows]))
            dense_row_of_slot[victims] = -1
        else:
            free = (row_of_slot < 0).nonzero().flatten()
            candidates = [r for r in rng.sample(pool, 60) if int(hashed.get(torch.tensor([r]))[0]) < 0]
            rows = torch.tensor(sorted(candidates)[: free.numel()], dtype=torch.int64)
            slots = free[torch.randperm(free.numel())[: rows.numel()]]
            if use_native:
                state = (row_of_slot, *zeros.values(), freq, pins)
                NATIVE.row_cache_install(rows, slots, hashed.tensors, num_rows, *state, 0)
            else:
                hashed.put(rows, slots)
                row_of_slot[slots] = rows
            dense_rows = torch.tensor([remap[int(r)] for r in rows], dtype=torch.int64)
            dense.put(dense_rows, slots)
            dense_row_of_slot[slots] = dense_rows
        probe = torch.tensor(sorted(rng.sample(pool, 200)), dtype=torch.int64)
        dense_probe = torch.tensor([remap[int(r)] for r in probe], dtype=torch.int64)
        expected = dense.get(dense_probe)
        assert torch.equal(hashed.get(probe), expected), step
        looked, missing = NATIVE.row_cache_lookup(hashed.tensors, num_rows, pins, probe)
        assert torch.equal(looked, expected), step
        assert torch.equal(missing, probe[expected < 0]), step
        pins.zero_()
        if num_rows < 2**32:
            rows, looked, _, _ = NATIVE.row_cache_lookup_ids(hashed.tensors, num_rows, pins, probe)
            assert torch.equal(looked, expected), step
            pins.zero_()
        assert torch.equal(row_of_slot >= 0, dense_row_of_slot >= 0)


def _caches(num_rows: int, capacity: int, algorithm: str):
    """Four caches over equal backings: (dense, hashed) x (torch path, native path where built)."""
    out = {}
    for kind in ("dense", "hash"):
        for use_native in (False, True) if NATIVE is not None else (False,):
            backing = {
                "weight": torch.arange(num_rows * 3, dtype=torch.float32).reshape(num_rows, 3),
                "state": torch.zeros(num_rows),
            }
            cache = RowCache(backing, capacity, algorithm, slot_map=kind)
            cache.use_native = use_native
            assert cache.slot_map_kind == kind
            out[(kind, use_native)] = cache
    return out


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(3))
def test_a_cache_with_the_hashed_map_gives_the_dense_maps_results(algorithm, seed):
    """Same slots, victims, write-backs and counters with either map, on both paths, over acquires by
    rows and by ids, growth beyond the capacity and shrinking back, flush and invalidate."""
    rng = random.Random(seed)
    num_rows, capacity = 400, 32
    caches = _caches(num_rows, capacity, algorithm)
    reference = caches[("dense", False)]
    in_flight = []
    for step in range(120):
        if in_flight and (len(in_flight) >= 3 or rng.random() < 0.45):
            tickets = in_flight.pop(rng.randrange(len(in_flight)))
            dirty = rng.random() < 0.7
            for key, cache in caches.items():
                slots = cache._tickets[tickets[key]]
                cache.tensors["weight"].index_add_(0, slots, torch.ones(slots.numel(), 3))  # a "kernel"
                cache.tensors["state"].index_add_(0, slots, torch.full((slots.numel(),), 0.5))
                cache.release(tickets[key], dirty=dirty)
        else:
            count = rng.randrange(0, 40)  # up to more than the capacity: growth, then shrinking
            draws = [min(int(rng.paretovariate(0.7)) - 1, num_rows - 1) for _ in range(count)]
            ids = torch.tensor(draws, dtype=torch.int64)
            by_ids = rng.random() < 0.5
            tickets, expected = {}, None
            for key, cache in caches.items():
                if by_ids:
                    tickets[key], slots = cache.acquire_ids(ids)
                else:
                    tickets[key], slots = cache.acquire(ids.unique())
                expected = slots if expected is None else expected
                assert torch.equal(slots, expected), (step, key)
            in_flight.append(tickets)
        if step == 80:
            for cache in caches.values():
                cache.flush()
        for cache in caches.values():
            assert_same_state(reference, cache)
    for tickets in in_flight:
        for key, cache in caches.items():
            cache.release(tickets[key], dirty=True)
    for cache in caches.values():
        cache.invalidate()
        assert_same_state(reference, cache)
    assert reference.counters.evictions > 0 and reference.size == capacity


def test_the_choice_rule_and_its_switch(monkeypatch):
    monkeypatch.delenv(SLOT_MAP_ENV, raising=False)
    # a table 2x the cache's rows of 260 bytes: 4 R is well under 1/32 of the buffers: dense
    assert choose_slot_map(None, 200_000, 100_000, 260)[0] == "dense"
    # 10x: 4 R is 15% of the buffers, more than the hashed map: hashed
    kind, reason = choose_slot_map(None, 1_000_000, 100_000, 260)
    assert kind == "hash" and "auto" in reason
    # a small table: the dense map is no larger than the hashed one
    assert choose_slot_map(None, 40, 0, 4)[0] == "dense"
    assert choose_slot_map("dense", 10**9, 10, 4) == ("dense", "slot_map='dense'")
    monkeypatch.setenv(SLOT_MAP_ENV, "hash")
    assert choose_slot_map(None, 40, 0, 4)[0] == "hash"
    assert choose_slot_map("dense", 40, 0, 4)[0] == "dense"  # the argument wins
    assert choose_slot_map(None, 10**9, 10, 4, device_bookkeeping=True)[0] == "dense"
    monkeypatch.setenv(SLOT_MAP_ENV, "Dense")
    assert choose_slot_map(None, 10**9, 10, 4)[0] == "dense"
    monkeypatch.setenv(SLOT_MAP_ENV, "sparse")
    with pytest.raises(ValueError, match=SLOT_MAP_ENV):
        choose_slot_map(None, 40, 0, 4)
    monkeypatch.setenv(SLOT_MAP_ENV, "auto")
    with pytest.raises(ValueError, match="slot_map='tree'"):
        RowCache({"w": torch.zeros(5, 1)}, 2, slot_map="tree")
    with pytest.raises(ValueError, match="device bookkeeping"):
        choose_slot_map("hash", 40, 0, 4, device_bookkeeping=True)
    assert [hash_entries(n) for n in (0, 8, 9, 100)] == [16, 16, 32, 256]


def test_resident_bookkeeping_does_not_grow_with_the_table_rows(monkeypatch):
    """A cache of 500 slots over tables of 10^3 to 10^7 rows (1-byte rows, so the backings stay small):
    the automatic choice hashes the large tables' maps, and the bookkeeping's bytes stay those of the
    slots, after the same acquires and evictions; the dense map's grow 4 bytes a table row."""
    monkeypatch.delenv(SLOT_MAP_ENV, raising=False)
    sizes = {}
    for num_rows in (10**5, 10**6, 10**7):
        backing = {"w": torch.zeros(num_rows, 1, dtype=torch.uint8)}
        cache = RowCache(backing, 500, "lru")
        gen = torch.Generator().manual_seed(0)
        for _ in range(20):
            ticket, _ = cache.acquire_ids(torch.randint(0, num_rows, (800,), generator=gen))
            cache.release(ticket, dirty=True)
        assert cache.slot_map_kind == "hash" and cache.counters.evictions > 0
        sizes[num_rows] = cache.bookkeeping_bytes
        dense = RowCache(backing, 500, "lru", slot_map="dense")
        assert dense.bookkeeping_bytes >= 4 * num_rows
    assert len(set(sizes.values())) == 1, sizes
    assert sizes[10**7] <= 500 * (29 + 48)
