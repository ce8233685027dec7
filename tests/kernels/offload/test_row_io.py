"""FileRowIO (preadv / pwritev of rows) against the mapped tensors of the same backing file."""

import pytest
import torch

from shardkit.kernels.offload.backing_store import BackingStore
from shardkit.kernels.offload.row_cache import RowCache
from shardkit.kernels.offload.row_io import row_runs

FIELDS = {"weight": ((40, 5), torch.float32), "state.m": ((40,), torch.float32), "q": ((40, 3), torch.uint8)}


def _store(tmp_path):
    store = BackingStore.create(FIELDS, {"t": 1}, str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    store.tensors["weight"].copy_(torch.randn(40, 5, generator=gen))
    store.tensors["state.m"].copy_(torch.rand(40, generator=gen))
    store.tensors["q"].copy_(torch.randint(0, 255, (40, 3), generator=gen, dtype=torch.uint8))
    return store


def test_row_runs_coalesce_consecutive_rows():
    assert row_runs(torch.tensor([3, 4, 5, 9, 11, 12])) == ([0, 3, 4], [3, 1, 2], [3, 9, 11])
    assert row_runs(torch.tensor([7])) == ([0], [1], [7])
    assert row_runs(torch.zeros(0, dtype=torch.int64)) == ([], [], [])


@pytest.mark.parametrize("rows", [[0, 1, 2, 7, 8, 20, 39], [39], [], list(range(40))])
def test_read_equals_mapped_tensors(tmp_path, rows):
    store = _store(tmp_path)
    io = store.row_io()
    index = torch.tensor(rows, dtype=torch.int64)
    got = io.read_fields(index)
    for name, tensor in store.tensors.items():
        assert got[name].dtype == tensor.dtype
        assert torch.equal(got[name], tensor.index_select(0, index))


def test_write_lands_in_mapped_tensors(tmp_path):
    store = _store(tmp_path)
    expected = {n: t.clone() for n, t in store.tensors.items()}
    index = torch.tensor([1, 2, 3, 10, 30, 31], dtype=torch.int64)
    values = {
        "weight": torch.randn(6, 5),
        "state.m": torch.rand(6),
        "q": torch.randint(0, 255, (6, 3), dtype=torch.uint8),
    }
    store.row_io().write_fields(index, values)
    for name in FIELDS:
        expected[name].index_copy_(0, index, values[name])
        assert torch.equal(store.tensors[name], expected[name])


def test_short_read_names_file_and_field(tmp_path):
    store = _store(tmp_path)
    io = store.row_io()
    offset, shape, dtype = io.regions["q"]
    io.regions["q"] = (offset + 10**9, shape, dtype)  # beyond the end of the file
    with pytest.raises(OSError, match="short read of field 'q'"):
        io.read_fields(torch.tensor([0]))


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_cache_with_row_io_matches_cache_on_tensors(tmp_path, algorithm):
    """The same acquire / update / release sequence through preadv/pwritev and through the mapped
    tensors (each on its own copy of the file) leaves bitwise equal backing contents and buffers."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _store(tmp_path / "a")
    b = BackingStore.create(FIELDS, {"t": 1}, str(tmp_path / "b"))
    for name in FIELDS:
        b.tensors[name].copy_(a.tensors[name])
    caches = [
        RowCache(dict(a.tensors), 6, algorithm, row_io=a.row_io()),
        RowCache(dict(b.tensors), 6, algorithm, io_chunk_rows=4, after_io=b.drop_resident),
    ]
    gen = torch.Generator().manual_seed(1)
    for step in range(25):
        rows = torch.randperm(40, generator=gen)[: 1 + step % 9]
        for cache in caches:
            ticket, slots = cache.acquire(rows)
            cache.tensors["weight"].index_add_(0, slots, torch.full((slots.numel(), 5), 0.5))
            cache.tensors["state.m"].index_add_(0, slots, torch.full((slots.numel(),), 0.25))
            cache.release(ticket, dirty=True)
        assert torch.equal(caches[0].row_of_slot, caches[1].row_of_slot)
    for cache in caches:
        cache.flush()
    assert caches[0].counters == caches[1].counters
    for name in FIELDS:
        assert torch.equal(a.tensors[name], b.tensors[name])


@pytest.mark.parametrize("window_bytes, chunk_windows", [(64 << 10, 256), (64, 1), (64, 3)])
def test_dense_rows_read_through_mapping_equal_preadv(tmp_path, monkeypatch, window_bytes, chunk_windows):
    """Rows sharing fault-around windows go through the mapping (pages dropped every chunk of
    windows); the values equal the positioned reads'."""
    import shardkit.kernels.offload.row_io as row_io

    store = _store(tmp_path)
    drops = []
    io = row_io.FileRowIO(
        store.row_io().fd, store.row_io().regions, "f", store.tensors, lambda: drops.append(1)
    )
    plain = store.row_io()
    plain.mapped = {}  # positioned reads only
    monkeypatch.setattr(row_io, "FAULT_AROUND_BYTES", window_bytes)
    monkeypatch.setattr(row_io, "MAPPED_WINDOWS", chunk_windows)
    rows = torch.arange(0, 40, 2)  # 20 runs of one row
    mapped_fields = [n for n in FIELDS if io._faults_are_cheaper(n, rows, 20)]
    assert mapped_fields, "no field chose the mapping: the dense path is not exercised"
    got, expected = io.read_fields(rows), plain.read_fields(rows)
    for name in FIELDS:
        assert torch.equal(got[name], expected[name])
        assert torch.equal(got[name], store.tensors[name].index_select(0, rows))
    windows = sum(
        -(-io._windows(n, rows).numel() // chunk_windows) for n in mapped_fields
    )  # one drop per chunk of windows
    assert len(drops) == windows


# ---- read_into / write_from: the native C++ loop and the pure-Python path, bitwise alike


def _backends():
    from shardkit.kernels import native_enabled_by_env, native_ops

    # where the native kernels are expected (a compiler, not switched off) they must really run here
    return ["torch"] + (["native"] if native_enabled_by_env() and native_ops() is not None else [])


def test_native_row_io_builds_on_this_machine():
    from shardkit.kernels import native_enabled_by_env, native_ops

    if native_enabled_by_env():
        assert hasattr(native_ops(), "file_read_rows") and hasattr(native_ops(), "file_write_rows")


def _buffers(capacity, fill=0):
    return {
        n: torch.full((capacity, *s[1:]), fill, dtype=d)
        if d != torch.uint8
        else torch.full((capacity, *s[1:]), 7, dtype=d)
        for n, (s, d) in FIELDS.items()
    }


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize(
    "rows", [[0, 1, 2, 7, 8, 20, 39], [39, 3, 4, 5, 0, 17], [5], [], list(range(40)), list(range(39, -1, -1))]
)
def test_read_into_equals_mapped_tensors(tmp_path, backend, rows):
    store = _store(tmp_path)
    index = torch.tensor(rows, dtype=torch.int64)
    slots = torch.randperm(50, generator=torch.Generator().manual_seed(len(rows)))[: len(rows)]
    buffers = _buffers(50)
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[slots] = False
    store.row_io().read_into(index, buffers, slots, backend=backend)
    for name, tensor in store.tensors.items():
        assert torch.equal(buffers[name].index_select(0, slots), tensor.index_select(0, index))
        assert torch.equal(buffers[name][untouched], _buffers(50)[name][untouched])  # nothing else written


@pytest.mark.parametrize("backend", _backends())
def test_write_from_lands_in_mapped_tensors(tmp_path, backend):
    store = _store(tmp_path)
    expected = {n: t.clone() for n, t in store.tensors.items()}
    index = torch.tensor([31, 1, 2, 3, 10, 30], dtype=torch.int64)
    slots = torch.tensor([4, 0, 7, 2, 5, 1])
    gen = torch.Generator().manual_seed(2)
    buffers = {
        "weight": torch.randn(8, 5, generator=gen),
        "state.m": torch.rand(8, generator=gen),
        "q": torch.randint(0, 255, (8, 3), generator=gen, dtype=torch.uint8),
    }
    store.row_io().write_from(index, buffers, slots, backend=backend)
    for name in FIELDS:
        expected[name].index_copy_(0, index, buffers[name].index_select(0, slots))
        assert torch.equal(store.tensors[name], expected[name])


@pytest.mark.parametrize("backend", _backends())
def test_adjacent_rows_take_one_call_per_run_and_field(tmp_path, backend):
    store = _store(tmp_path)
    rows = torch.tensor([0, 1, 2, 7, 8, 20])  # runs 0..2, 7..8, 20 -> 3 runs x 3 fields
    slots = torch.tensor([5, 2, 9, 0, 1, 3])  # any slots: the destination need not be contiguous
    io = store.row_io()
    io.merge_gap = 0  # runs apart in the file stay apart (the native default moves small gaps too)
    assert io.read_into(rows, _buffers(10), slots, backend=backend) == 9
    assert io.write_from(rows, _buffers(10), slots, backend=backend) == 9


def _native_or_skip():
    if "native" not in _backends():
        pytest.skip("the native kernels are not built here")


def test_native_gaps_move_in_one_call_and_leave_the_gap_bytes_alone(tmp_path):
    """Rows a few bytes apart (every other row, and across the small fields' regions): with the
    default merge gap the native path reads them all in one preadv (the gaps into a throw-away
    buffer) and writes them by one read + one write of the span, which leaves every byte it was not
    asked to write as it was."""
    _native_or_skip()
    store = _store(tmp_path)
    io = store.row_io()
    rows = torch.tensor([1, 3, 5, 9, 20, 22, 38])
    slots = torch.tensor([6, 0, 3, 1, 5, 2, 4])
    buffers = _buffers(7)
    assert io.read_into(rows, buffers, slots, backend="native") == 1
    for name, tensor in store.tensors.items():
        assert torch.equal(buffers[name].index_select(0, slots), tensor.index_select(0, rows))
    expected = {n: t.clone() for n, t in store.tensors.items()}
    gen = torch.Generator().manual_seed(3)
    buffers = {
        "weight": torch.randn(7, 5, generator=gen),
        "state.m": torch.rand(7, generator=gen),
        "q": torch.randint(0, 255, (7, 3), generator=gen, dtype=torch.uint8),
    }
    assert io.write_from(rows, buffers, slots, backend="native") == 2  # read the span, write it back
    for name in FIELDS:
        expected[name].index_copy_(0, rows, buffers[name].index_select(0, slots))
        assert torch.equal(store.tensors[name], expected[name])
    io.merge_gap = 0
    assert io.read_into(rows, _buffers(7), slots, backend="native") == 3 * 7  # a call per row and field


def test_native_write_span_is_bounded(tmp_path):
    """A write that moves gaps goes through a scratch span of at most 1 MiB: rows 4 KiB wide, every
    other one written (gaps of one row, within the merge gap), 2.4 MiB in all -> 3 spans, 2 calls each;
    the rows between keep their bytes."""
    _native_or_skip()
    fields = {"weight": ((600, 1024), torch.float32)}
    store = BackingStore.create(fields, {"t": 2}, str(tmp_path))
    before = torch.randn(600, 1024, generator=torch.Generator().manual_seed(4))
    store.tensors["weight"].copy_(before)
    io = store.row_io()
    rows = torch.arange(0, 600, 2)
    values = {"weight": torch.randn(300, 1024, generator=torch.Generator().manual_seed(5))}
    slots = torch.arange(300)
    calls = io.write_from(rows, values, slots, backend="native")
    # 1 MiB holds 256 rows: rows 0..254 (span 255 rows), then 256..510, then 512..598
    assert calls == 6
    expected = before.clone()
    expected[rows] = values["weight"]
    assert torch.equal(store.tensors["weight"], expected)
    got = {"weight": torch.zeros(300, 1024)}
    assert io.read_into(rows, got, slots, backend="native") == 1  # reads: no span limit
    assert torch.equal(got["weight"], values["weight"])


@pytest.mark.parametrize("backend", _backends())
def test_read_into_short_read_is_an_oserror_naming_the_file(tmp_path, backend):
    store = _store(tmp_path)
    io = store.row_io()
    offset, shape, dtype = io.regions["q"]
    io.regions["q"] = (offset + 10**9, shape, dtype)  # beyond the end of the file
    with pytest.raises(
        OSError, match=r"short read.*" if backend == "native" else "short read of field 'q'"
    ) as e:
        io.read_into(torch.tensor([0]), _buffers(2), torch.tensor([1]), backend=backend)
    assert store.path in str(e.value)


def test_read_into_rejects_mismatched_arguments(tmp_path):
    io = _store(tmp_path).row_io()
    with pytest.raises(ValueError, match="2 rows but 1 slots"):
        io.read_into(torch.tensor([0, 1]), _buffers(2), torch.tensor([0]))
    with pytest.raises(ValueError, match="buffers for fields"):
        io.read_into(torch.tensor([0]), {"weight": torch.zeros(2, 5)}, torch.tensor([0]))
    if "native" in _backends():
        with pytest.raises(OSError, match="slot 5 at position 0 outside buffer"):
            io.read_into(torch.tensor([0]), _buffers(2), torch.tensor([5]), backend="native")


def test_kernel_backend_torch_switches_the_native_row_io_off(tmp_path, monkeypatch):
    from shardkit.kernels import kernel_backend

    io = _store(tmp_path).row_io()
    assert io._native(_buffers(1), "auto") is (
        None if _backends() == ["torch"] else io._native(_buffers(1), "native")
    )
    with kernel_backend("torch"):
        assert io._native(_buffers(1), "auto") is None


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_cache_native_and_torch_row_io_leave_identical_files(tmp_path, algorithm):
    """The same training-like sequence through a cache whose misses move by the native loop and one
    whose misses move by the pure-Python path: bitwise equal files, buffers and counters."""
    from shardkit.kernels import kernel_backend

    backends = _backends()
    if len(backends) < 2:
        pytest.skip("the native kernels are not built here: nothing to compare the pure path with")
    stores, caches = [], []
    for name in backends:
        (tmp_path / name).mkdir()
        store = _store(tmp_path / name)
        stores.append(store)
        caches.append(RowCache(dict(store.tensors), 6, algorithm, row_io=store.row_io()))
    gen = torch.Generator().manual_seed(1)
    for step in range(25):
        rows = torch.randperm(40, generator=gen)[: 1 + step % 9]
        for backend, cache in zip(backends, caches):
            with kernel_backend(backend):
                ticket, slots = cache.acquire(rows)
                cache.tensors["weight"].index_add_(0, slots, torch.full((slots.numel(), 5), 0.5))
                cache.tensors["state.m"].index_add_(0, slots, torch.full((slots.numel(),), 0.25))
                cache.release(ticket, dirty=True)
        assert torch.equal(caches[0].row_of_slot, caches[1].row_of_slot)
        for name in FIELDS:
            assert torch.equal(caches[0].tensors[name], caches[1].tensors[name])
    for backend, cache in zip(backends, caches):
        with kernel_backend(backend):
            cache.flush()
    assert caches[0].counters == caches[1].counters
    for name in FIELDS:
        assert torch.equal(stores[0].tensors[name], stores[1].tensors[name])


def test_native_op_reads_and_writes_one_record_per_row(tmp_path):
    """The native op's other layout: each row one record of all its fields (field f of row r at
    ``offsets[f] + r * stride``): a run of adjacent rows is one call for all fields together."""
    import os

    from shardkit.kernels import native_ops

    if "native" not in _backends():
        pytest.skip("the native kernels are not built here")
    rows_in_file, header = 30, 64
    record = torch.randn(rows_in_file, 6, generator=torch.Generator().manual_seed(5))  # 5 weights + 1 state
    path = tmp_path / "records"
    path.write_bytes(b"\0" * header + record.numpy().tobytes())
    fd = os.open(path, os.O_RDWR)
    try:
        rows = torch.tensor([4, 5, 6, 20, 2])
        slots = torch.tensor([0, 3, 1, 2, 4])
        weight, state = torch.zeros(5, 5), torch.zeros(5)
        offsets = [header, header + 20]
        calls, _ = native_ops().file_read_rows(fd, rows, slots, [weight, state], offsets, [24, 24])
        assert calls == 3  # runs 4..6, 20, 2: both fields in one call each
        assert torch.equal(weight[slots], record[rows, :5]) and torch.equal(state[slots], record[rows, 5])
        weight.add_(1.0)
        state.sub_(2.0)
        native_ops().file_write_rows(fd, rows, slots, [weight, state], [header, header + 20], [24, 24])
        expected = record.clone()
        expected[rows, :5] = weight[slots]
        expected[rows, 5] = state[slots]
        written = torch.frombuffer(bytearray(path.read_bytes()[header:]), dtype=torch.float32).view(
            rows_in_file, 6
        )
        assert torch.equal(written, expected)
    finally:
        os.close(fd)


def test_backing_store_descriptor_is_advised_random(tmp_path, monkeypatch):
    """The store's descriptor reads scattered rows: it is advised POSIX_FADV_RANDOM (no readahead of
    neighbours no miss asked for, small page-cache folios that a row's write-back is cheap into), on
    created and on opened files."""
    import os

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise on this OS")
    advised = []
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        advised.append((fd, offset, length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    store = _store(tmp_path)
    assert (store.row_io().fd, 0, 0, os.POSIX_FADV_RANDOM) in advised
    advised.clear()
    opened = BackingStore.open(store.path, FIELDS, {"t": 1})
    assert (opened.row_io().fd, 0, 0, os.POSIX_FADV_RANDOM) in advised


# ---- native reads on several threads


def _big_store(tmp_path, rows=3000):
    fields = {"weight": ((rows, 6), torch.float32), "state": ((rows,), torch.float32)}
    store = BackingStore.create(fields, {"t": "threads"}, str(tmp_path))
    gen = torch.Generator().manual_seed(1)
    store.tensors["weight"].copy_(torch.randn(rows, 6, generator=gen))
    store.tensors["state"].copy_(torch.rand(rows, generator=gen))
    return store


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_native_reads_on_several_threads_equal_one_thread(tmp_path, threads):
    """A read of many rows shared among reader threads (each a part of the file order) lands the same
    bytes in the same slots as one thread, and only there, with the same (merged) calls."""
    if "native" not in _backends():
        pytest.skip("native kernels not built")
    store = _big_store(tmp_path)
    gen = torch.Generator().manual_seed(threads)
    rows = torch.randperm(3000, generator=gen)[:1500].sort().values
    slots = torch.randperm(2000, generator=gen)[:1500]
    io = store.row_io()
    io.read_threads = threads
    got = {"weight": torch.full((2000, 6), -1.0), "state": torch.full((2000,), -1.0)}
    calls = io.read_into(rows, got, slots, backend="native")
    io.read_threads = 1
    want = {"weight": torch.full((2000, 6), -1.0), "state": torch.full((2000,), -1.0)}
    single = io.read_into(rows, want, slots, backend="native")
    for name in got:
        assert torch.equal(got[name], want[name]), name
        assert torch.equal(got[name].index_select(0, slots), store.tensors[name].index_select(0, rows))
    assert calls == single  # the parts are cut between calls


def test_native_read_error_on_a_reader_thread_is_an_oserror_naming_the_file(tmp_path):
    if "native" not in _backends():
        pytest.skip("native kernels not built")
    store = _big_store(tmp_path)
    io = store.row_io()
    io.read_threads, io.merge_gap = 4, 0  # 3000 calls: the state field's are the helper threads' parts
    offset, shape, dtype = io.regions["state"]
    io.regions["state"] = (offset + 10**9, shape, dtype)  # the state field's part: beyond the end
    rows = torch.arange(0, 3000, 2)
    buffers = {"weight": torch.zeros(1500, 6), "state": torch.zeros(1500)}
    with pytest.raises(OSError, match="short read") as e:
        io.read_into(rows, buffers, torch.arange(1500), backend="native")
    assert store.path in str(e.value)
    assert torch.equal(buffers["weight"][:750], store.tensors["weight"][rows[:750]])  # the caller's part


def test_read_threads_default_and_environment(monkeypatch):
    from shardkit.kernels.offload import row_io

    monkeypatch.delenv(row_io.READ_THREADS_ENV, raising=False)
    monkeypatch.setattr(row_io.os, "cpu_count", lambda: 1)
    assert row_io.read_threads_default() == 1
    monkeypatch.setattr(row_io.os, "cpu_count", lambda: 16)
    assert row_io.read_threads_default() == 2
    monkeypatch.setenv(row_io.READ_THREADS_ENV, "3")
    assert row_io.read_threads_default() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(row_io.READ_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=row_io.READ_THREADS_ENV):
            row_io.read_threads_default()


def test_native_reads_of_many_calls_share_them_among_threads(tmp_path):
    """Reader threads really share a read: 1500 rows, every other one, with merging off, are 3000
    calls; on 3 threads each makes a third of them (the same calls as one thread makes); a read of fewer
    than 128 calls a thread stays on one thread."""
    if "native" not in _backends():
        pytest.skip("native kernels not built")
    store = _big_store(tmp_path)
    io = store.row_io()
    io.merge_gap = 0
    rows, slots = torch.arange(0, 3000, 2), torch.randperm(1500, generator=torch.Generator().manual_seed(0))
    for threads in (1, 3):
        io.read_threads = threads
        buffers = {"weight": torch.zeros(1500, 6), "state": torch.zeros(1500)}
        assert io.read_into(rows, buffers, slots, backend="native") == 3000
        assert io.last_read_threads == threads
        assert torch.equal(buffers["weight"].index_select(0, slots), store.tensors["weight"][rows])
    io.read_threads = 8
    assert io.read_into(rows[:100], buffers, slots[:100], backend="native") == 200
    assert io.last_read_threads == 1
