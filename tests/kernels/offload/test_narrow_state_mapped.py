"""A narrow optimizer state kept mapped (BackingStore.keep_fields_mapped) while the other fields move by
row I/O: the cache moves the narrow field's rows with index ops on its mapped tensor, the weights with
preadv / pwritev (docs/offload/costs.md, "Narrow state kept mapped").

- a cache whose row_io covers some fields leaves bitwise the files, buffers and counters of a cache that
  moves every field through the tensors (LRU / LFU, with and without write-behind, native and pure-torch
  row I/O);
- drop_resident unmaps every page but the kept fields' (smaps' Rss of the mapping);
- the policy (narrow_state_fields, its switch) and bad input (unknown fields);
- an offloaded lookup with row-wise Adagrad trains bitwise like the in-memory one, state kept mapped or
  not.
"""

from __future__ import annotations

import os

import pytest
import torch

from shardkit.kernels.offload.backing_store import BackingStore
from shardkit.kernels.offload.narrow_state import KEEP_NARROW_STATE_ENV, narrow_state_fields
from shardkit.kernels.offload.row_cache import RowCache
from shardkit.kernels.offload.write_behind import WriteBehind

FIELDS = {"weight": ((40, 5), torch.float32), "state.m": ((40,), torch.float32), "q": ((40, 3), torch.uint8)}


def _store(directory, fill: bool = True) -> BackingStore:
    store = BackingStore.create(FIELDS, {"t": 1}, str(directory))
    if fill:
        gen = torch.Generator().manual_seed(0)
        store.tensors["weight"].copy_(torch.randn(40, 5, generator=gen))
        store.tensors["state.m"].copy_(torch.rand(40, generator=gen))
        store.tensors["q"].copy_(torch.randint(0, 255, (40, 3), generator=gen, dtype=torch.uint8))
    return store


def _backends():
    from shardkit.kernels import native_ops

    native = native_ops()
    return ["native", "torch"] if native is not None and hasattr(native, "file_read_rows") else ["torch"]


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("write_behind", [False, True])
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_cache_with_a_field_kept_mapped_matches_cache_on_tensors(tmp_path, algorithm, write_behind, backend):
    from shardkit.kernels import kernel_backend

    if backend not in _backends():
        pytest.skip("the native kernels are not built here")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _store(tmp_path / "a")
    b = _store(tmp_path / "b")
    assert a.keep_fields_mapped(["state.m", "q"]) == 40 * 4 + 40 * 3
    io = a.row_io(["weight"])
    assert list(io.regions) == ["weight"]
    caches = [
        RowCache(
            dict(a.tensors), 6, algorithm, row_io=io, write_behind=WriteBehind(io) if write_behind else None
        ),
        RowCache(dict(b.tensors), 6, algorithm, io_chunk_rows=4, after_io=b.drop_resident),
    ]
    assert caches[0]._direct_fields == ["state.m", "q"] and caches[1]._direct_fields == []
    gen = torch.Generator().manual_seed(1)
    with kernel_backend(backend):
        for step in range(30):
            rows = torch.randperm(40, generator=gen)[: 1 + step % 9]
            for cache in caches:
                ticket, slots = cache.acquire(rows)
                cache.tensors["weight"].index_add_(0, slots, torch.full((slots.numel(), 5), 0.5))
                cache.tensors["state.m"].index_add_(0, slots, torch.full((slots.numel(),), 0.25))
                cache.tensors["q"].index_add_(0, slots, torch.ones((slots.numel(), 3), dtype=torch.uint8))
                cache.release(ticket, dirty=True)
                a.drop_resident()
            assert torch.equal(caches[0].row_of_slot, caches[1].row_of_slot)
            for name in FIELDS:
                assert torch.equal(caches[0].tensors[name], caches[1].tensors[name]), (step, name)
        for cache in caches:
            cache.flush()
    assert caches[0].counters == caches[1].counters
    assert caches[0].counters.rows_written > 0
    for name in FIELDS:
        assert torch.equal(a.tensors[name], b.tensors[name]), name


def _mapping_rss_kib(store: BackingStore) -> int:
    """Rss of the store's mapping in this process (/proc/self/smaps), KiB."""
    start, size = store._base, len(store._mapping)
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            if low == start and high >= start + size - 4096:
                for entry in lines[i + 1 :]:
                    if entry.startswith("Rss:"):
                        return int(entry.split()[1])
    raise AssertionError("the mapping is not in /proc/self/smaps")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps (Linux)")
def test_drop_resident_unmaps_all_but_the_kept_fields(tmp_path):
    fields = {"weight": ((4096, 64), torch.float32), "state.m": ((4096,), torch.float32)}
    state_kib = 4096 * 4 // 1024
    for keep in (False, True):
        store = BackingStore.create(fields, {"t": int(keep)}, str(tmp_path))
        if keep:
            assert store.keep_fields_mapped(["state.m"]) == 4096 * 4
            assert store.kept_bytes == 4096 * 4
        for tensor in store.tensors.values():
            tensor.add_(1.0)  # every page touched and dirty
        assert _mapping_rss_kib(store) >= 1024 + state_kib
        store.drop_resident()
        assert _mapping_rss_kib(store) == (state_kib if keep else 0)
        assert bool((store.tensors["weight"] == 1.0).all()) and bool((store.tensors["state.m"] == 1.0).all())
        store.close()


def test_narrow_state_fields_and_their_switch(monkeypatch):
    fields = {
        "weight": ((10, 64), torch.float32),  # 256 bytes a row, but the weights
        "state.momentum": ((10,), torch.float32),
        "state.pair": ((10, 2), torch.float32),
        "state.exp_avg": ((10, 4), torch.float32),
    }
    narrow = ["state.momentum", "state.pair"]  # 12 bytes a row: 120 over the table's 10 rows
    monkeypatch.delenv(KEEP_NARROW_STATE_ENV, raising=False)
    # auto: kept while 120 <= 1/8 of the cache's bytes (284 a row over all fields)
    assert narrow_state_fields(fields, 10) == narrow  # 2840 / 8 = 355
    assert narrow_state_fields(fields, 4) == narrow  # 1136 / 8 = 142
    assert narrow_state_fields(fields, 3) == []  # 852 / 8 = 106.5: through the file like the weights
    assert narrow_state_fields(fields, 100) == narrow  # a cache of more rows than the table: all of it
    for off in ("0", "off", "false", " No "):
        monkeypatch.setenv(KEEP_NARROW_STATE_ENV, off)
        assert narrow_state_fields(fields, 10) == []
    for on in ("1", "on", "TRUE"):
        monkeypatch.setenv(KEEP_NARROW_STATE_ENV, on)
        assert narrow_state_fields(fields, 1) == narrow  # forced, whatever the sizes
    for auto in ("", "auto"):
        monkeypatch.setenv(KEEP_NARROW_STATE_ENV, auto)
        assert narrow_state_fields(fields, 3) == [] and narrow_state_fields(fields, 4) == narrow
    monkeypatch.setenv(KEEP_NARROW_STATE_ENV, "maybe")
    with pytest.raises(ValueError, match=r"SHARDKIT_OFFLOAD_KEEP_NARROW_STATE='maybe'"):
        narrow_state_fields(fields, 10)


def test_unknown_fields_are_refused(tmp_path):
    store = _store(tmp_path, fill=False)
    with pytest.raises(ValueError, match=r"has no fields \['nope'\]"):
        store.row_io(["weight", "nope"])
    with pytest.raises(ValueError, match=r"has no fields \['nope'\]"):
        store.keep_fields_mapped(["nope"])
    io = store.row_io(["weight"])
    with pytest.raises(ValueError, match=r"row_io moves fields \['weight'\]"):
        RowCache({"q": store.tensors["q"]}, 4, row_io=io)


@pytest.mark.parametrize("keep", ["1", "0"])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_offloaded_rowwise_adagrad_trains_like_in_memory(monkeypatch, keep, backend):
    from shardkit.kernels import kernel_backend
    from shardkit.kernels.offload import OffloadSpec
    from shardkit.modules import EmbeddingBagConfig, FusedOptimizerConfig, OptimType
    from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup, ShardSpec
    from shardkit.modules.offloaded_lookup import OffloadedEmbeddingLookup

    if backend not in _backends():
        pytest.skip("the native kernels are not built here")
    monkeypatch.setenv(KEEP_NARROW_STATE_ENV, keep)
    rows, dim, bags = 30, 4, 6
    tables = [EmbeddingBagConfig(rows, dim, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(2)]
    config = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=0.1)
    shards = [ShardSpec(t) for t in tables]
    torch.manual_seed(0)
    with kernel_backend(backend):
        memory = GroupedEmbeddingLookup(shards, True, "cpu", config)
        offloaded = OffloadedEmbeddingLookup(shards, True, "cpu", config, OffloadSpec("caching", 0.1))
        with torch.no_grad():
            offloaded.weight.copy_(memory.weight)
        direct = offloaded.cache._direct_fields
        assert direct == ([f"state.{n}" for n in offloaded.state_names] if keep == "1" else [])
        loss_weight = torch.arange(1.0, dim + 1)
        for step in range(12):
            gen = torch.Generator().manual_seed(step)
            lengths = torch.randint(0, 4, (2 * bags,), generator=gen)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            ids = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
            outs = [lk(ids, offsets, [bags, bags]) for lk in (memory, offloaded)]
            assert torch.equal(outs[1], outs[0]), f"step {step}"
            for out in outs:
                out.mul(loss_weight).sum().backward()
        stats = offloaded.cache_stats()["t0+t1"]
        assert stats["evictions"] > 0 and stats["rows_written"] > 0, stats
        offloaded.sync_storage()
    assert torch.equal(offloaded.weight, memory.weight)
    expected = memory.optimizer.state_slices(0, 2 * rows)
    for name, value in offloaded.optimizer.state_slices(0, 2 * rows).items():
        assert torch.equal(value, expected[name]), name
