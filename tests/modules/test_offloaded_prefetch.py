"""Prefetch of an offloaded lookup (modules/offloaded_lookup.py, modules/offload_prefetch.py), driven as
PrefetchTrainPipelineSparseDist drives it: forward of batch i, prefetch of batch i+1, backward of batch
i (the fused optimizer updates batch i's cached rows while the prefetch fills other slots), forward of
batch i+1 (which takes the prefetched rows over).

- with a cache of 4 of 40 rows (every step evicts dirty rows, the buffers grow for two batches), the
  lookup trains bitwise like the in-memory one, with the prefetch on the background thread and inline;
  the forwards acquire nothing themselves;
- an exception in the background prefetch is raised, with its message, by the next forward (or by
  ``sync_storage`` when no forward comes), and the lookup works again afterwards;
- a forward of other ids than prefetched acquires its own and releases the prefetch's pins; an id out of
  range in a prefetch gives the forward's error naming the feature;
- the pipeline's order (batch i+1's prefetch asked for before batch i's forward, two in flight): bitwise
  like in memory under eviction pressure, no pinned row evicted, and a forward does not wait for the
  next batch's prefetch (held inside its load while the forward runs).
"""

from __future__ import annotations

import threading

import pytest
import torch

from shardkit.distributed.validation import set_validation, validation_enabled
from shardkit.kernels.offload import OffloadSpec
from shardkit.modules import EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup, ShardSpec
from shardkit.modules.offloaded_lookup import OffloadedEmbeddingLookup

ROWS, DIM, BAGS = 20, 4, 6


def _lookups(background: bool, device: str = "cpu", rows: int = ROWS, dim: int = DIM, load_factor=0.1):
    tables = [EmbeddingBagConfig(rows, dim, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(2)]
    config = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=0.1)
    shards = [ShardSpec(t) for t in tables]
    torch.manual_seed(0)
    memory = GroupedEmbeddingLookup(shards, True, device, config)
    offloaded = OffloadedEmbeddingLookup(
        shards, True, device, config, OffloadSpec("caching", load_factor, prefetch=True)
    )
    offloaded.background_prefetch = background
    with torch.no_grad():
        offloaded.weight.copy_(memory.weight)
    return memory, offloaded


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (2 * BAGS,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    return ids, offsets


def _record_acquires(lookup: OffloadedEmbeddingLookup) -> list:
    """Wrap the lookup's acquisition to record the name of the thread each one ran on."""
    threads = []
    acquire = lookup._acquire_rows

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return acquire(*args)

    lookup._acquire_rows = recorded
    return threads


@pytest.mark.parametrize("background", [True, False])
def test_prefetched_training_equals_in_memory(background):
    memory, offloaded = _lookups(background)
    threads = _record_acquires(offloaded)
    steps = 12
    loss_weight = torch.arange(1.0, DIM + 1)
    pending = None
    for step in range(steps):
        ids, offsets = _batch(step)
        outs = [lk(ids, offsets, [BAGS, BAGS]) for lk in (memory, offloaded)]
        assert torch.equal(outs[1], outs[0]), f"step {step}"
        if step + 1 < steps:  # the pipeline's prefetch of the next batch, before this backward
            offloaded.prefetch(*_batch(step + 1), [BAGS, BAGS])
        for out in outs:
            out.mul(loss_weight).sum().backward()
        pending = offloaded._prefetched
    assert not pending
    offloaded.sync_storage()
    assert torch.equal(offloaded.weight, memory.weight)
    for name, value in memory.optimizer.state_slices(0, 2 * ROWS).items():
        assert torch.equal(offloaded.optimizer.state_slices(0, 2 * ROWS)[name], value), name
    # one acquisition a batch: the first batch's by its forward, every other one by its prefetch
    main = threading.current_thread().name
    assert threads[0] == main and len(threads) == steps
    worker = [name.startswith("shardkit-offload-prefetch") for name in threads[1:]]
    assert all(worker) if background else not any(worker), threads
    stats = offloaded.cache_stats()["t0+t1"]
    assert stats["evictions"] > 0 and stats["rows_written"] > 0, stats


def _failing_load(cache, message: str):
    """Make the cache's next load on the prefetch thread raise OSError(message)."""
    load = cache._load

    def failing(rows, slots):
        if threading.current_thread().name.startswith("shardkit-offload-prefetch"):
            cache._load = load
            raise OSError(5, message)
        return load(rows, slots)

    cache._load = failing


def test_an_exception_in_the_background_prefetch_is_raised_by_the_next_forward():
    memory, offloaded = _lookups(True)
    ids, offsets = _batch(0)
    offloaded(ids, offsets, [BAGS, BAGS]).sum().backward()
    memory(ids, offsets, [BAGS, BAGS]).sum().backward()
    next_ids, next_offsets = _batch(1)
    _failing_load(offloaded.cache, "injected read failure")
    offloaded.prefetch(next_ids, next_offsets, [BAGS, BAGS])  # fails in the background: not raised here
    with pytest.raises(OSError, match="injected read failure"):
        offloaded(next_ids, next_offsets, [BAGS, BAGS])
    assert offloaded.cache.pinned_tickets == ()  # nothing left pinned by the failed prefetch
    # the next try reads the rows itself and trains on as the in-memory lookup does
    outs = [lk(next_ids, next_offsets, [BAGS, BAGS]) for lk in (memory, offloaded)]
    assert torch.equal(outs[1], outs[0])
    for out in outs:
        out.sum().backward()
    offloaded.sync_storage()
    assert torch.equal(offloaded.weight, memory.weight)


def test_a_failed_prefetch_without_a_forward_is_raised_by_sync_storage():
    _, offloaded = _lookups(True)
    _failing_load(offloaded.cache, "injected read failure")
    offloaded.prefetch(*_batch(1), [BAGS, BAGS])
    with pytest.raises(OSError, match="injected read failure"):
        offloaded.sync_storage()
    offloaded.sync_storage()  # raised once; the cache is consistent
    assert offloaded.cache.pinned_tickets == ()


def test_a_forward_of_other_ids_acquires_its_own_and_releases_the_prefetch():
    memory, offloaded = _lookups(True)
    offloaded.prefetch(*_batch(1), [BAGS, BAGS])
    ids, offsets = _batch(2)
    outs = [lk(ids, offsets, [BAGS, BAGS]) for lk in (memory, offloaded)]
    assert torch.equal(outs[1], outs[0])
    assert len(offloaded.cache.pinned_tickets) == 1  # the forward's, awaiting its backward
    for out in outs:
        out.sum().backward()
    assert offloaded.cache.pinned_tickets == ()


# -1 for f0: a row before the buffer (the prefetch fails); for f1: t0's last row (the prefetch loads it,
# the forward's check refuses the id; without the check it would be a valid row); 2**32 + 1: a row that
# int32 would wrap to 1 (the prefetch deduplicates int32 rows only when every row is in range)
CASES = [(True, 0, -1), (True, -1, -1), (False, 0, -1), (False, 0, 2**32 + 1), (True, -1, 2**32 + 1)]


@pytest.mark.parametrize("validate, position, value", CASES)
def test_an_id_out_of_range_in_a_prefetch_gives_the_forwards_error(validate, position, value):
    previous = validation_enabled()
    set_validation(validate)
    try:
        _check_out_of_range(position, value)
    finally:
        set_validation(previous)


def _check_out_of_range(position: int, value: int) -> None:
    ids, offsets = _batch(3)
    ids[position] = value
    _, plain = _lookups(True)
    with pytest.raises(IndexError) as without_prefetch:
        plain(ids, offsets, [BAGS, BAGS])
    _, offloaded = _lookups(True)
    offloaded.prefetch(ids, offsets, [BAGS, BAGS])
    with pytest.raises(IndexError) as with_prefetch:
        offloaded(ids, offsets, [BAGS, BAGS])
    assert f"f{0 if position == 0 else 1}" in str(with_prefetch.value)
    assert str(with_prefetch.value) == str(without_prefetch.value)
    assert offloaded.cache.pinned_tickets == ()


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (tools/device_check.sh runs these)"
)
CUDA_ROWS, CUDA_DIM, CUDA_BAGS = 2000, 64, 64


def _cuda_batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(0, 8, (2 * CUDA_BAGS,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, CUDA_ROWS, (int(lengths.sum()),), generator=gen)
    return ids.cuda(), offsets.cuda()


def _sleep_on(stream) -> None:
    """Keep ``stream`` busy for about a millisecond (so work ordered after it really waits)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "copies, bookkeeping",
    [("zero-copy", "device"), ("zero-copy", "host"), ("staged", "host"), ("compute stream", "host")],
)
def test_prefetched_training_on_cuda_equals_in_memory(monkeypatch, copies, bookkeeping):
    """A CUDA cache (host backing) of 5 % of the rows driven in the pipeline's order, with the compute
    stream kept busy before every prefetch and backward and the copy stream kept busy before every read:
    a copy not ordered after the compute stream's queued updates (a dirty victim gathered too early), or
    a kernel not waiting for its rows' copies, would train on stale rows. Training stays bitwise that of
    the in-memory lookup, with the copies on the side stream, zero-copy (the GPU reading and writing the
    pinned backing) and staged (``SHARDKIT_OFFLOAD_UVA=0``), and on the caller's stream
    (``SHARDKIT_OFFLOAD_COPY_STREAM=0``); zero-copy with the cache's bookkeeping on the device (the
    default, kernels/offload/device_slots.py) and on the host (``SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING=0``;
    the other copies always keep it on the host)."""
    monkeypatch.setenv("SHARDKIT_OFFLOAD_COPY_STREAM", "0" if copies == "compute stream" else "1")
    monkeypatch.setenv("SHARDKIT_OFFLOAD_UVA", "0" if copies == "staged" else "1")
    monkeypatch.setenv("SHARDKIT_OFFLOAD_DEVICE_BOOKKEEPING", "1" if bookkeeping == "device" else "0")
    memory, offloaded = _lookups(False, "cuda", CUDA_ROWS, CUDA_DIM, load_factor=0.05)
    cache = offloaded.cache
    assert cache.bookkeeping == bookkeeping, cache.bookkeeping_reason
    assert (cache._copies is not None) == (copies != "compute stream")
    if cache._copies is not None:
        assert (cache._copies.views is not None) == (copies == "zero-copy")
    if cache._copies is not None:  # the copy stream busy before each read: the kernels must wait for it
        read = cache._copies.read

        def delayed_read(*args):
            _sleep_on(cache._copies.stream)
            return read(*args)

        cache._copies.read = delayed_read
    compute = torch.cuda.current_stream()
    bags = [CUDA_BAGS, CUDA_BAGS]
    loss_weight = torch.arange(1.0, CUDA_DIM + 1, device="cuda")
    steps = 10
    for step in range(steps):
        ids, offsets = _cuda_batch(step)
        outs = [lk(ids, offsets, bags) for lk in (memory, offloaded)]
        assert torch.equal(outs[1], outs[0]), f"step {step}"
        if step + 1 < steps:
            _sleep_on(compute)  # this step's forward still queued when the prefetch evicts and reads
            offloaded.prefetch(*_cuda_batch(step + 1), bags)
        _sleep_on(compute)
        for out in outs:
            out.mul(loss_weight).sum().backward()
    offloaded.sync_storage()
    if cache._copies is not None:
        assert cache._copies.pending_writes == 0
    assert torch.equal(offloaded.weight, memory.weight.cpu())
    for name, value in memory.optimizer.state_slices(0, 2 * CUDA_ROWS).items():
        assert torch.equal(offloaded.optimizer.state_slices(0, 2 * CUDA_ROWS)[name], value.cpu()), name
    stats = offloaded.cache_stats()["t0+t1"]
    assert stats["evictions"] > 0 and stats["rows_written"] > 0 and stats["misses"] > 0, stats


def test_copy_stream_switch_is_read_strictly(monkeypatch):
    from shardkit.kernels.offload.device_copies import copy_stream_default

    for value, want in (("0", False), ("off", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("SHARDKIT_OFFLOAD_COPY_STREAM", value)
        assert copy_stream_default() is want
    monkeypatch.setenv("SHARDKIT_OFFLOAD_COPY_STREAM", "maybe")
    with pytest.raises(ValueError, match="SHARDKIT_OFFLOAD_COPY_STREAM='maybe'"):
        copy_stream_default()


@pytest.mark.cuda
@needs_cuda
def test_a_device_view_reads_and_writes_the_pinned_host_memory():
    from shardkit.kernels.offload.device_copies import device_view

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        host = torch.arange(12).to(dtype).view(4, 3).pin_memory()
        view = device_view(host, torch.device("cuda"))
        assert view.is_cuda and view.shape == host.shape and view.dtype == dtype
        assert torch.equal(view.index_select(0, torch.tensor([2, 0], device="cuda")).cpu(), host[[2, 0]])
        view.index_copy_(
            0, torch.tensor([1], device="cuda"), torch.full((1, 3), 7, dtype=dtype, device="cuda")
        )
        torch.cuda.synchronize()
        assert torch.equal(host[1], torch.full((3,), 7, dtype=dtype)), dtype


def test_a_device_view_needs_pinned_memory():
    from shardkit.kernels.offload.device_copies import device_view

    with pytest.raises(ValueError, match="contiguous pinned CPU tensor"):
        device_view(torch.zeros(4, 3), torch.device("cuda"))


def _count_pinned_evictions(lookup: OffloadedEmbeddingLookup) -> list:
    """Wrap the cache's eviction to add to cell[0] the victims that were pinned (a row of a batch in
    flight: must stay 0)."""
    cell = [0]
    cache, evict = lookup.cache, lookup.cache._evict

    def evicting(victims):
        cell[0] += int((cache._pins.index_select(0, victims) > 0).sum())
        return evict(victims)

    cache._evict = evicting
    return cell


@pytest.mark.parametrize("background", [True, False])
def test_prefetch_before_the_forward_equals_in_memory(background):
    """PrefetchTrainPipelineSparseDist's order: batch i+1's prefetch asked for before batch i's forward,
    two prefetches in flight. With a cache of 4 of 40 rows (every prefetch evicts) the lookup trains
    bitwise like the in-memory one, no pinned row is evicted, every forward takes its own prefetch over
    (acquiring nothing itself) and leaves the next batch's in flight."""
    memory, offloaded = _lookups(background)
    threads = _record_acquires(offloaded)
    pinned_evicted = _count_pinned_evictions(offloaded)
    steps = 12
    loss_weight = torch.arange(1.0, DIM + 1)
    offloaded.prefetch(*_batch(0), [BAGS, BAGS])
    for step in range(steps):
        if step + 1 < steps:  # the next batch's prefetch, before this forward
            offloaded.prefetch(*_batch(step + 1), [BAGS, BAGS])
        ids, offsets = _batch(step)
        outs = [lk(ids, offsets, [BAGS, BAGS]) for lk in (memory, offloaded)]
        assert torch.equal(outs[1], outs[0]), f"step {step}"
        assert len(offloaded._prefetched) == (1 if step + 1 < steps else 0), step  # the next stays
        for out in outs:
            out.mul(loss_weight).sum().backward()
    offloaded.sync_storage()
    assert torch.equal(offloaded.weight, memory.weight)
    for name, value in memory.optimizer.state_slices(0, 2 * ROWS).items():
        assert torch.equal(offloaded.optimizer.state_slices(0, 2 * ROWS)[name], value), name
    assert pinned_evicted == [0]
    assert len(threads) == steps  # one acquisition a batch, each by its prefetch
    worker = [name.startswith("shardkit-offload-prefetch") for name in threads]
    assert all(worker) if background else not any(worker), threads
    stats = offloaded.cache_stats()["t0+t1"]
    assert stats["evictions"] > 0 and stats["rows_written"] > 0, stats


def test_a_forward_does_not_wait_for_the_next_batchs_prefetch():
    """Batch 1's prefetch is held inside its load (on the worker, the cache's lock held) while batch 0's
    forward runs: that forward returns without waiting for it, takes its own prefetch over and leaves
    batch 1's in flight; batch 1's forward then waits for it and both match the in-memory lookup."""
    memory, offloaded = _lookups(True)
    batches = [_batch(0), _batch(1)]
    assert not set(batches[1][0].tolist()) <= set(batches[0][0].tolist())  # batch 1 has rows to load
    offloaded.prefetch(*batches[0], [BAGS, BAGS])
    offloaded.wait_for_prefetch()
    started, proceed = threading.Event(), threading.Event()
    load = offloaded.cache._load

    def held(rows, slots):
        started.set()
        if not proceed.wait(20):
            raise TimeoutError("the test did not let the prefetch go on")
        return load(rows, slots)

    offloaded.cache._load = held
    offloaded.prefetch(*batches[1], [BAGS, BAGS])
    try:
        assert started.wait(20)
        out = offloaded(*batches[0], [BAGS, BAGS])  # on a forward waiting for batch 1: a 20 s hang
        assert not proceed.is_set() and len(offloaded._prefetched) == 1
    finally:
        proceed.set()
    want = memory(*batches[0], [BAGS, BAGS])
    assert torch.equal(out, want)
    for o in (out, want):
        o.sum().backward()
    outs = [lk(*batches[1], [BAGS, BAGS]) for lk in (memory, offloaded)]
    assert torch.equal(outs[1], outs[0]) and not offloaded._prefetched
    assert offloaded.cache.pinned_tickets != ()  # batch 1's rows, pinned until its backward
