"""Evicted dirty rows written by a background thread (WriteBehind): the same file contents, rows and
counters as writing them in the step; a row evicted and asked again before its write lands reads the
new value; a write's error reaches the caller."""

import threading
import time

import pytest
import torch

from shardkit.kernels.offload.backing_store import BackingStore
from shardkit.kernels.offload.row_cache import RowCache
from shardkit.kernels.offload.write_behind import WriteBehind

ROWS = 60
FIELDS = {"weight": ((ROWS, 5), torch.float32), "state.m": ((ROWS,), torch.float32)}


def _store(directory):
    directory.mkdir()
    store = BackingStore.create(FIELDS, {"t": 1}, str(directory))
    gen = torch.Generator().manual_seed(0)
    store.tensors["weight"].copy_(torch.randn(ROWS, 5, generator=gen))
    store.tensors["state.m"].copy_(torch.rand(ROWS, generator=gen))
    return store


class SlowIO:
    """A row_io whose writes take ``delay`` seconds (after an optional gate): writes stay pending."""

    def __init__(self, row_io, delay: float = 0.0, gate: threading.Event = None, fail: bool = False):
        self.row_io, self.delay, self.gate, self.fail = row_io, delay, gate, fail

    def write_from(self, rows, buffers, slots):
        if self.gate is not None:
            self.gate.wait(timeout=30)
        time.sleep(self.delay)
        if self.fail:
            raise OSError("backing file 'x': No space left on device")
        return self.row_io.write_from(rows, buffers, slots)


def _step(cache, rows, add):
    ticket, slots = cache.acquire(rows)
    loaded = {name: t.index_select(0, slots).clone() for name, t in cache.tensors.items()}
    cache.tensors["weight"].index_add_(0, slots, torch.full((slots.numel(), 5), add))
    cache.tensors["state.m"].index_add_(0, slots, torch.full((slots.numel(),), add))
    cache.release(ticket, dirty=True)
    return loaded


@pytest.mark.parametrize("algorithm, limit", [("lru", 1 << 20), ("lfu", 1 << 20), ("lru", 64)])
def test_random_sequences_equal_writing_in_the_step(tmp_path, algorithm, limit):
    """Two copies of a file, one cache writing in the step, one through a (slow) write-behind thread
    (limit 64 bytes: every submit waits for the previous write): every acquire loads the same values,
    the same slots; after a flush the files are bitwise equal, and so are the counters."""
    a, b = _store(tmp_path / "a"), _store(tmp_path / "b")
    writer = WriteBehind(SlowIO(b.row_io(), delay=0.002), limit_bytes=limit, keepalive=b)
    caches = [
        RowCache(dict(a.tensors), 7, algorithm, row_io=a.row_io()),
        RowCache(dict(b.tensors), 7, algorithm, row_io=b.row_io(), write_behind=writer),
    ]
    gen = torch.Generator().manual_seed(3)
    for step in range(60):
        # small random batches over a few hot rows: evicted rows often come back at once
        rows = torch.randperm(14 if step % 3 else ROWS, generator=gen)[: 1 + step % 8]
        loaded = [_step(cache, rows, 0.5 + step) for cache in caches]
        for name in FIELDS:
            assert torch.equal(loaded[0][name], loaded[1][name]), (step, name)
        assert torch.equal(caches[0].row_of_slot, caches[1].row_of_slot), step
    assert writer.rows_written > 0  # the thread did write
    for cache in caches:
        cache.flush()
    assert writer.pending_bytes == 0
    assert caches[0].counters == caches[1].counters
    for name in FIELDS:
        assert torch.equal(a.tensors[name], b.tensors[name]), name


def test_a_row_asked_again_before_its_write_lands_reads_the_new_value(tmp_path):
    store = _store(tmp_path / "s")
    gate = threading.Event()
    writer = WriteBehind(SlowIO(store.row_io(), gate=gate), keepalive=store)
    cache = RowCache(dict(store.tensors), 1, "lru", row_io=store.row_io(), write_behind=writer)
    before = store.tensors["weight"][4].clone()
    _step(cache, torch.tensor([4]), 1.0)  # row 4 cached, updated (dirty)
    _step(cache, torch.tensor([9]), 1.0)  # evicts row 4: its write is held at the gate
    assert writer.pending_bytes > 0
    assert torch.equal(store.tensors["weight"][4], before)  # not in the file yet
    threading.Timer(0.3, gate.set).start()  # the acquire below must wait for the write
    loaded = _step(cache, torch.tensor([4]), 1.0)
    assert torch.equal(loaded["weight"][0], before + 1.0)


def test_a_failed_write_is_raised_by_the_next_call(tmp_path):
    store = _store(tmp_path / "s")
    # the failure waits for the gate: without it, a failure that lands before step 2's own load made
    # that load raise it (a race that the loaded test machine lost now and then)
    gate = threading.Event()
    writer = WriteBehind(SlowIO(store.row_io(), gate=gate, fail=True), keepalive=store)
    cache = RowCache(dict(store.tensors), 1, "lru", row_io=store.row_io(), write_behind=writer)
    _step(cache, torch.tensor([1]), 1.0)
    _step(cache, torch.tensor([2]), 1.0)  # evicts row 1: its write fails in the background
    gate.set()
    with pytest.raises(OSError, match="No space left"):
        cache.flush()
    cache.flush()  # raised once; the cache itself is consistent


def test_write_behind_needs_host_buffers(tmp_path):
    store = _store(tmp_path / "s")
    with pytest.raises(ValueError, match="host buffers"):
        RowCache(dict(store.tensors), 2, "lru", device="meta", write_behind=WriteBehind(store.row_io()))


def test_wait_for_waits_only_for_a_pending_job_holding_one_of_the_rows(tmp_path):
    """wait_for searches each pending job's (ascending) rows: a row among them waits for the writes,
    rows elsewhere (between, before or after them) do not."""
    store = _store(tmp_path / "s")
    gate = threading.Event()
    writer = WriteBehind(SlowIO(store.row_io(), gate=gate), keepalive=store)
    rows = torch.tensor([3, 10, 11, 40])
    writer.submit(rows, {n: t.index_select(0, rows).clone() for n, t in store.tensors.items()})
    for others in ([0, 2], [4, 9, 12, 39], [41, 59], []):
        start = time.perf_counter()
        writer.wait_for(torch.tensor(others, dtype=torch.int64))
        assert writer.pending_bytes > 0, others  # returned without waiting for the gated write
        assert time.perf_counter() - start < 5
    threading.Timer(0.2, gate.set).start()
    writer.wait_for(torch.tensor([1, 11, 50]))  # 11 is pending: waits for the write
    assert writer.pending_bytes == 0 and writer.rows_written == 4


def test_submit_refuses_rows_that_do_not_ascend(tmp_path):
    store = _store(tmp_path / "s")
    writer = WriteBehind(store.row_io(), keepalive=store)
    rows = torch.tensor([5, 2])
    with pytest.raises(ValueError, match="ascending"):
        writer.submit(rows, {n: t.index_select(0, rows).clone() for n, t in store.tensors.items()})


def test_two_threads_under_eviction_pressure_with_a_slow_writer_lose_no_update(tmp_path):
    """A prefetch-like thread and the main thread acquire, update in place and release rows of their own
    ranges of a backing file, through a 6-row cache whose victims a slow write-behind thread writes: a
    pinned row never leaves its slot while its ticket is out (checked after each in-place update), and
    after a flush the file holds every update."""
    store = _store(tmp_path / "s")
    for tensor in store.tensors.values():  # zeros: a row's value is then its count of updates, exactly
        tensor.zero_()
    writer = WriteBehind(SlowIO(store.row_io(), delay=0.001), keepalive=store)
    cache = RowCache(dict(store.tensors), 6, "lru", row_io=store.row_io(), write_behind=writer)
    counts = [torch.zeros(ROWS), torch.zeros(ROWS)]
    errors = []

    def hammer(lo, hi, seed, count):
        gen = torch.Generator().manual_seed(seed)
        try:
            for _ in range(80):
                rows = (
                    (
                        lo
                        + torch.randperm(hi - lo, generator=gen)[
                            : 1 + int(torch.randint(5, (1,), generator=gen))
                        ]
                    )
                    .sort()
                    .values
                )
                ticket, slots = cache.acquire(rows)
                with cache.buffers_in_use():
                    cache.tensors["weight"].index_add_(0, slots, torch.ones(slots.numel(), 5))
                    cache.tensors["state.m"].index_add_(0, slots, torch.ones(slots.numel()))
                    assert torch.equal(cache.row_of_slot.index_select(0, slots), rows), "a pinned row moved"
                count.index_add_(0, rows, torch.ones(rows.numel()))
                cache.release(ticket, dirty=True)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    other = threading.Thread(target=hammer, args=(30, ROWS, 1, counts[1]), daemon=True)
    other.start()
    hammer(0, 30, 2, counts[0])
    other.join(60)
    assert not other.is_alive() and not errors, errors
    cache.flush()
    assert writer.rows_written > 0 and writer.pending_bytes == 0
    total = counts[0] + counts[1]
    assert torch.equal(store.tensors["weight"], total[:, None].expand(ROWS, 5))
    assert torch.equal(store.tensors["state.m"], total)
