"""The row cache's device bookkeeping (kernels/offload/device_slots.py), run on CPU tensors here (the same
torch ops as on a GPU: ``RowCache(..., bookkeeping="device")`` over an in-memory backing) and on CUDA in
the ``cuda``-marked tests.

- the random acquire / update / release / flush / invalidate sequences of test_row_cache.py against the
  plain-Python model and a reference table (resident rows, sizes, counters, content, backing);
- lockstep against the host bookkeeping, native and pure torch: the same slots for every id, the same
  counters, maps, stamps, counts and backing, with repeated ids and eviction pressure;
- pins across two acquires in flight, dirty write-back on eviction and flush, LRU / LFU victims on
  hand-made cases, ids out of range, the selection of the path (argument and environment variable);
- an offloaded lookup whose cache keeps its bookkeeping this way trains bitwise like the in-memory one;
- (``cuda``) acquires and releases on one stream: another one refused while a ticket is pinned.
"""

from __future__ import annotations

import random

import pytest
import torch

from shardkit.kernels import kernel_backend
from shardkit.kernels.embedding import RowOutOfRange, native_for
from shardkit.kernels.offload.device_slots import ENV_VAR, choose_bookkeeping, device_bookkeeping_setting
from shardkit.kernels.offload.row_cache import RowCache
from tests.kernels.offload.test_row_cache import _backing, _run_random_sequence

HOST_PATHS = ["torch"] + (["native"] if native_for(torch.device("cpu")) is not None else [])
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (tools/device_check.sh runs these)"
)


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
@pytest.mark.parametrize("capacity", [0, 1, 4, 10, 40])
def test_random_sequences_match_the_model(capacity, algorithm):
    for seed in range(3):
        _run_random_sequence(capacity, algorithm, seed, "cpu", steps=160, bookkeeping="device")


def _state(cache: RowCache) -> dict:
    return {
        "slot_of_row": cache.slot_of_row.cpu(),
        "row_of_slot": cache.row_of_slot.cpu(),
        "pins": cache._pins.cpu(),
        "dirty": cache._dirty.cpu(),
        "stamp": cache._stamp.cpu(),
        "freq": cache._freq.cpu(),
    }


def _lockstep(host_path: str, algorithm: str, capacity: int, seed: int, device: str = "cpu") -> dict:
    """Drive a host-bookkeeping cache and a device-bookkeeping one with the same random sequence of
    acquire_ids (repeated ids) / in-place updates / release / flush; compare after every step."""
    num_rows = 60
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    backings = [_backing(num_rows, seed), _backing(num_rows, seed)]
    if device == "cuda":
        backings = [{k: v.pin_memory() for k, v in b.items()} for b in backings]
    host = RowCache(backings[0], capacity, algorithm, device, bookkeeping="host")
    dev = RowCache(backings[1], capacity, algorithm, device, bookkeeping="device")
    host.use_native = host_path == "native"
    outstanding, seen = [], {"grew": 0, "evictions": 0}
    weights = [1.0 / (r + 1) ** 1.1 for r in range(num_rows)]
    for step in range(120):
        what = f"step {step} ({host_path}, {algorithm}, capacity {capacity}, seed {seed})"
        choice = rng.random()
        if choice < 0.5 and len(outstanding) < 2:
            ids = torch.tensor(rng.choices(range(num_rows), weights, k=rng.choice([1, 4, 9, 17])))
            size = host.size
            got = [cache.acquire_ids(ids.to(device)) for cache in (host, dev)]
            seen["grew"] += host.size > size
            assert got[0][0] == got[1][0], what
            assert torch.equal(got[0][1].cpu(), got[1][1].cpu()), f"{what}: slots"
            slots = got[0][1].unique()
            delta = torch.randn(slots.numel(), 4, generator=gen).to(device)
            for cache in (host, dev):
                cache.tensors["weight"][slots] += delta
                cache.tensors["codes"][slots] += 3
            outstanding.append(got[0][0])
        elif choice < 0.85 and outstanding:
            ticket = outstanding.pop(rng.randrange(len(outstanding)))
            dirty = rng.random() < 0.7
            for cache in (host, dev):
                cache.release(ticket, dirty)
        else:
            for cache in (host, dev):
                cache.flush()
            if not outstanding:
                for name in backings[0]:
                    assert torch.equal(backings[0][name], backings[1][name]), f"{what}: backing {name}"
        assert host.counters == dev.counters, what
        assert host.size == dev.size and host._resident == dev._resident, what
        for name, value in _state(host).items():
            assert torch.equal(value, _state(dev)[name]), f"{what}: {name}"
        for name in host.tensors:
            assert torch.equal(host.tensors[name].cpu(), dev.tensors[name].cpu()), f"{what}: {name}"
    for ticket in outstanding:
        for cache in (host, dev):
            cache.release(ticket, True)
    for cache in (host, dev):
        cache.flush()
    for name in backings[0]:
        assert torch.equal(backings[0][name], backings[1][name]), f"end: backing {name}"
    seen["evictions"] = dev.counters.evictions
    return seen


@pytest.mark.parametrize("host_path", HOST_PATHS)
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_lockstep_with_the_host_bookkeeping(host_path, algorithm):
    seen = {"grew": 0, "evictions": 0}
    for capacity, seed in ((3, 0), (8, 1), (20, 2), (0, 3)):
        with kernel_backend("torch") if host_path == "torch" else _nothing():
            for key, value in _lockstep(host_path, algorithm, capacity, seed).items():
                seen[key] += value
    assert seen["grew"] > 0 and seen["evictions"] > 0, seen  # the pressure the test claims


def test_lockstep_without_nonzero_static(monkeypatch):
    """The misses and dirty victims picked by a stable sort of their flags where nonzero_static does
    not run (torch < 2.6 on CUDA): the same steps as the host path."""
    from shardkit.kernels.offload import device_slots

    monkeypatch.setattr(device_slots, "static_nonzero_runs_on", lambda device: False)
    mask = torch.tensor([False, True, True, False, True])
    assert device_slots.true_positions(mask, 3).tolist() == [1, 2, 4]
    seen = {"grew": 0, "evictions": 0}
    for capacity, seed in ((3, 0), (8, 1)):
        for key, value in _lockstep(HOST_PATHS[-1], "lru", capacity, seed).items():
            seen[key] += value
    assert seen["evictions"] > 0, seen


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cache(capacity: int, algorithm: str = "lru", rows: int = 12):
    backing = _backing(rows)
    return RowCache(backing, capacity, algorithm, bookkeeping="device"), backing


def test_pins_hold_across_two_acquires_in_flight():
    cache, backing = _cache(4)
    first, slots_a = cache.acquire_ids(torch.tensor([0, 1, 2, 1]))
    cache.tensors["weight"][slots_a.unique()] += 100.0
    # a second acquire in flight with 3 misses and only 1 free slot: the cache grows, never evicting 0-2
    second, slots_b = cache.acquire_ids(torch.tensor([5, 6, 7]))
    assert cache.size == 6 and cache.counters.evictions == 0
    assert set(slots_b.tolist()).isdisjoint(slots_a.tolist())
    assert torch.equal(cache.row_of_slot[slots_a], torch.tensor([0, 1, 2, 1]))
    # releasing the second one clean, a third acquire may evict 5-7, still not the pinned 0-2
    cache.release(second, dirty=False)
    third, slots_c = cache.acquire_ids(torch.tensor([8, 9, 10]))
    assert set(slots_c.tolist()).isdisjoint(slots_a.tolist())
    assert sorted(cache.resident_rows().tolist()) == [0, 1, 2, 8, 9, 10]
    cache.release(first, dirty=True)
    cache.release(third, dirty=False)
    assert cache.size == 4  # shrunk back with nothing pinned: dirty rows 0-2 evicted or kept, not lost
    cache.flush()
    expected = _backing(12)["weight"][:3] + 100.0
    assert torch.equal(backing["weight"][:3], expected)


def test_dirty_victims_are_written_back_and_clean_ones_not():
    cache, backing = _cache(2)
    original = backing["weight"].clone()
    ticket, slots = cache.acquire_ids(torch.tensor([3]))
    cache.tensors["weight"][slots[0]] = 7.0  # row 3 updated in place
    cache.release(ticket, dirty=True)
    ticket, _ = cache.acquire_ids(torch.tensor([4]))
    cache.release(ticket, dirty=False)  # row 3 less recent: goes first
    ticket, _ = cache.acquire_ids(torch.tensor([5, 6]))  # evicts 3 (dirty) and 4 (clean)
    assert cache.counters.evictions == 2 and cache.counters.rows_written == 1
    assert torch.equal(backing["weight"][3], torch.full((4,), 7.0))
    assert torch.equal(backing["weight"][4], original[4])
    cache.tensors["weight"][cache.slot_of_row[5].long()] = -1.0
    cache.release(ticket, dirty=True)
    cache.flush()  # flush writes the dirty rows 5 and 6; they stay cached, clean
    assert cache.counters.rows_written == 3 and not bool(cache._dirty.any())
    assert torch.equal(backing["weight"][5], torch.full((4,), -1.0))
    assert sorted(cache.resident_rows().tolist()) == [5, 6]


@pytest.mark.parametrize(
    "algorithm, uses, victims",
    [
        # LRU: the least recently acquired go first
        ("lru", [[0, 1, 2, 3], [0], [2]], [1, 3]),
        # LFU: the fewest acquisitions since loaded; ties (1 and 3: one each) by recency
        ("lfu", [[0, 1, 2, 3], [3], [0], [0], [2], [3], [1]], [1, 2]),
    ],
)
def test_victim_order(algorithm, uses, victims):
    cache, _ = _cache(4, algorithm)
    for rows in uses:
        ticket, _ = cache.acquire_ids(torch.tensor(rows))
        cache.release(ticket, dirty=False)
    ticket, _ = cache.acquire_ids(torch.tensor([10, 11]))
    cache.release(ticket, dirty=False)
    resident = set(cache.resident_rows().tolist())
    assert resident == ({0, 1, 2, 3} - set(victims)) | {10, 11}


def test_ids_out_of_range_raise_and_leave_nothing_pinned():
    cache, _ = _cache(3)
    ticket, _ = cache.acquire_ids(torch.tensor([1, 2]))
    cache.release(ticket, dirty=False)
    with pytest.raises(RowOutOfRange):
        cache.acquire_ids(torch.tensor([2, 12, 1]))
    with pytest.raises(RowOutOfRange):
        cache.acquire_ids(torch.tensor([-1, 2]))
    assert int(cache._pins.sum()) == 0 and cache.pinned_tickets == ()
    with pytest.raises(TypeError):
        cache.acquire_ids(torch.tensor([1.0]))
    ticket, slots = cache.acquire_ids(torch.zeros(0, dtype=torch.int64))
    assert slots.numel() == 0
    cache.release(ticket, dirty=False)


class _Copies:
    def __init__(self, views):
        self.views = views


def test_path_selection(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    host_backing = {"w": torch.zeros(2, 2)}
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert device_bookkeeping_setting() is None
    # a CUDA cache: the device path where the copies are zero-copy, else the host, saying why
    assert choose_bookkeeping(None, cuda, host_backing, _Copies({}), None, None)[0] == "device"
    mode, why = choose_bookkeeping(None, cuda, host_backing, _Copies(None), None, None)
    assert mode == "host" and "zero-copy" in why
    mode, why = choose_bookkeeping(None, cuda, host_backing, None, None, None)
    assert mode == "host" and "compute stream" in why
    # a CPU cache keeps the host path whatever the variable says
    monkeypatch.setenv(ENV_VAR, "1")
    assert choose_bookkeeping(None, cpu, host_backing, None, None, None)[0] == "host"
    with pytest.raises(ValueError, match="cannot apply.*zero-copy"):
        choose_bookkeeping(None, cuda, host_backing, _Copies(None), None, None)
    monkeypatch.setenv(ENV_VAR, "0")
    assert choose_bookkeeping(None, cuda, host_backing, _Copies({}), None, None) == ("host", f"{ENV_VAR}=0")
    monkeypatch.setenv(ENV_VAR, "perhaps")
    with pytest.raises(ValueError, match="perhaps"):
        RowCache(_backing(4), 2, device="cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.delenv(ENV_VAR)
    # the argument: refused where the backing cannot be indexed from the cache's device
    with pytest.raises(ValueError, match="positioned I/O"):
        choose_bookkeeping("device", cpu, host_backing, None, object(), None)
    with pytest.raises(ValueError, match="write-behind"):
        choose_bookkeeping("device", cpu, host_backing, None, None, object())
    with pytest.raises(ValueError, match="bookkeeping must be one of"):
        RowCache(_backing(4), 2, bookkeeping="gpu")
    assert RowCache(_backing(4), 2).bookkeeping == "host"


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_offloaded_lookup_trains_like_in_memory(background, algorithm):
    """The prefetch order of PrefetchTrainPipelineSparseDist (tests/modules/test_offloaded_prefetch.py),
    the lookup's cache replaced by one with the device bookkeeping over the same backing fields."""
    from tests.modules.test_offloaded_prefetch import BAGS, DIM, ROWS, _batch, _lookups

    memory, offloaded = _lookups(background)
    fields = offloaded.cache.backing
    offloaded.cache = RowCache(fields, 4, algorithm, bookkeeping="device")
    loss_weight = torch.arange(1.0, DIM + 1)
    steps = 12
    for step in range(steps):
        ids, offsets = _batch(step)
        outs = [lk(ids, offsets, [BAGS, BAGS]) for lk in (memory, offloaded)]
        assert torch.equal(outs[1], outs[0]), f"step {step}"
        if step + 1 < steps:
            offloaded.prefetch(*_batch(step + 1), [BAGS, BAGS])
        for out in outs:
            out.mul(loss_weight).sum().backward()
    offloaded.sync_storage()
    assert torch.equal(offloaded.weight, memory.weight)
    for name, value in memory.optimizer.state_slices(0, 2 * ROWS).items():
        assert torch.equal(offloaded.optimizer.state_slices(0, 2 * ROWS)[name], value), name
    stats = offloaded.cache_stats()["t0+t1"]
    assert stats["evictions"] > 0 and stats["rows_written"] > 0, stats


# the random sequences on CUDA, both bookkeeping paths: test_row_cache.py::test_random_sequences_on_cuda


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_lockstep_on_cuda(algorithm):
    for capacity, seed in ((3, 0), (8, 1), (20, 2)):
        _lockstep(HOST_PATHS[-1], algorithm, capacity, seed, device="cuda")


@pytest.mark.cuda
@needs_cuda
def test_cuda_cache_defaults_to_the_device_path(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("SHARDKIT_OFFLOAD_UVA", raising=False)
    monkeypatch.delenv("SHARDKIT_OFFLOAD_COPY_STREAM", raising=False)
    backing = {k: v.pin_memory() for k, v in _backing(12).items()}
    cache = RowCache(backing, 4, device="cuda")
    assert cache.bookkeeping == "device" and cache.slot_of_row.is_cuda and cache._pins.is_cuda
    monkeypatch.setenv(ENV_VAR, "0")
    assert RowCache(backing, 4, device="cuda").bookkeeping == "host"
    monkeypatch.setenv(ENV_VAR, "1")
    monkeypatch.setenv("SHARDKIT_OFFLOAD_UVA", "0")
    with pytest.raises(ValueError, match="cannot apply"):
        RowCache(backing, 4, device="cuda")


@pytest.mark.cuda
@needs_cuda
def test_one_stream_on_cuda():
    """Acquires and releases of a device-bookkept cache run on one stream: another stream is refused
    while a ticket is pinned (the error says why and what to do), and takes over once none is."""
    backing = {k: v.pin_memory() for k, v in _backing(12).items()}
    cache = RowCache(backing, 4, device="cuda", bookkeeping="device")
    ids = torch.tensor([1, 5, 5, 7], device="cuda")
    ticket, _ = cache.acquire_ids(ids)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with pytest.raises(RuntimeError, match="one CUDA stream.*torch.cuda.stream"):
            cache.release(ticket, dirty=False)
        with pytest.raises(RuntimeError, match="one CUDA stream"):
            cache.acquire_ids(ids)
    assert cache.pinned_tickets == (ticket,)
    cache.release(ticket, dirty=True)
    with torch.cuda.stream(side):  # nothing pinned: the side stream takes over
        ticket, slots = cache.acquire_ids(torch.tensor([2, 5], device="cuda"))
        cache.release(ticket, dirty=False)
        cache.flush()
    assert cache._stream == side and int(cache._pins.sum()) == 0
    assert torch.equal(cache.resident_rows(), torch.tensor([1, 2, 5, 7]))
