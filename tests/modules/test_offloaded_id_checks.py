"""The id checks of an offloaded lookup folded into its cache's one host sync (issue 24).

With its bookkeeping on the device (kernels/offload/device_slots.py; here on CPU tensors,
``RowCache(bookkeeping="device")``), an offloaded lookup checks each id against its shard in the
acquire's host sync (``RowCache.acquire_ids(id_check=...)``), not in a sync of its own before it, and
its kernel skips the bounds check on the cache's slot ids. This file checks that:

- an id outside its shard (below the buffer, past it, or in another shard's rows) raises exactly the
  error of the in-memory lookup (feature, table, id, range), with one shard (row-wise: rows 5-25 of a
  table), two shards with the same id range and two with different ones, prefetched or not, and
  leaves nothing pinned; with validation off (``SHARDKIT_VALIDATE=0``), an id outside the buffer still
  raises that error and an id in another shard's rows reads that row, as in memory;
- a training step (forward, prefetch of the next batch, backward) makes exactly one call that needs
  values on the host (``shardkit.testing.dispatch_counts``: a host sync on a GPU), with validation on,
  for every layout, as many as the in-memory lookup (its id check); with the pure-torch kernels, which
  sync themselves, as many as the in-memory lookup;
- a prefetch matches its forward's ids given as other views of the same memory without reading them
  (a sharded module splits its input into new views a call; on a GPU, ``torch.equal`` syncs), and not
  once that memory was written (the rows were acquired for the old values);
- the stream rule of a CUDA device-bookkept cache (``DeviceSlots._bind_stream``), with stand-in
  streams (the ``cuda``-marked test in test_row_cache_device.py runs it on real ones).
"""

from __future__ import annotations

import pytest
import torch

from shardkit.distributed.validation import set_validation, validation_enabled
from shardkit.kernels.embedding import select_backend
from shardkit.kernels.offload import OffloadSpec
from shardkit.kernels.offload.row_cache import RowCache
from shardkit.modules import EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.modules.grouped_lookup import GroupedEmbeddingLookup, ShardSpec
from shardkit.modules.offloaded_lookup import OffloadedEmbeddingLookup
from shardkit.testing.dispatch_counts import DispatchCounts

DIM, BAGS = 4, 6
# (name, [(table rows, shard row_start, shard row_end)]): the layouts of a group's shards
LAYOUTS = {
    "one row-wise shard": [(300, 50, 250)],
    "two shards, same ids": [(200, 0, 200), (200, 0, 200)],
    "two shards, other ids": [(200, 0, 200), (400, 100, 350)],
}


def _lookups(layout: str, load_factor: float = 0.02):
    shards = [
        ShardSpec(EmbeddingBagConfig(rows, DIM, name=f"t{i}", feature_names=[f"f{i}"]), start, end)
        for i, (rows, start, end) in enumerate(LAYOUTS[layout])
    ]
    config = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=0.1)
    torch.manual_seed(0)
    memory = GroupedEmbeddingLookup(shards, True, "cpu", config)
    spec = OffloadSpec("caching", load_factor, prefetch=True)
    offloaded = OffloadedEmbeddingLookup(shards, True, "cpu", config, spec)
    offloaded.background_prefetch = False
    with torch.no_grad():
        offloaded.weight.copy_(memory.weight)
    fields = offloaded.cache.backing
    offloaded.cache = RowCache(fields, offloaded.cache.capacity, "lru", bookkeeping="device")
    return memory, offloaded


def _batch(layout: str, step: int):
    """Valid ids of every feature of ``layout`` (BAGS bags each)."""
    gen = torch.Generator().manual_seed(step)
    features = LAYOUTS[layout]
    lengths = torch.randint(1, 4, (len(features) * BAGS,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = []
    for f, (_, start, end) in enumerate(features):
        count = int(lengths[f * BAGS : (f + 1) * BAGS].sum())
        ids.append(torch.randint(start, end, (count,), generator=gen))
    return torch.cat(ids), offsets, [BAGS] * len(features)


def _bad_values(layout: str):
    """(position, value, what) of ids outside their shard: the last id (of the last feature)."""
    features = LAYOUTS[layout]
    start, end = features[-1][1], features[-1][2]
    cases = [(-1, -1, "below the buffer"), (-1, 10**6, "past the buffer")]
    cases.append((-1, start - 1, "before the shard"))
    if len(features) > 1:
        cases.append((-1, end, "past the shard"))
    return cases


@pytest.fixture
def validation():
    previous = validation_enabled()
    yield set_validation
    set_validation(previous)


@pytest.mark.parametrize("prefetched", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ids_outside_their_shard_raise_the_in_memory_error(layout, prefetched, validation):
    validation(True)
    for position, value, what in _bad_values(layout):
        ids, offsets, bags = _batch(layout, 1)
        ids[position] = value
        memory, offloaded = _lookups(layout)
        with pytest.raises(IndexError) as expected:
            memory(ids, offsets, bags)
        if prefetched:
            offloaded.prefetch(ids, offsets, bags)
        with pytest.raises(IndexError) as got:
            offloaded(ids, offsets, bags)
        assert str(got.value) == str(expected.value), (what, str(got.value))
        assert f"f{len(LAYOUTS[layout]) - 1}" in str(got.value) and str(value) in str(got.value), what
        assert offloaded.cache.pinned_tickets == () and int(offloaded.cache._pins.sum()) == 0, what
        # and the lookup goes on: a valid batch trains as in memory
        ids, offsets, bags = _batch(layout, 2)
        assert torch.equal(offloaded(ids, offsets, bags), memory(ids, offsets, bags)), what


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_without_validation_as_in_memory(layout, validation):
    validation(False)
    for position, value, what in _bad_values(layout):
        ids, offsets, bags = _batch(layout, 1)
        ids[position] = value
        memory, offloaded = _lookups(layout)
        try:
            want = memory(ids, offsets, bags)
        except (IndexError, RuntimeError) as error:
            # outside the buffer: the native kernel's IndexError, named by the lookup (the pure-torch
            # kernel's RuntimeError from embedding_bag); the cache refuses such an id on every backend
            with pytest.raises(IndexError) as got:
                offloaded(ids, offsets, bags)
            if isinstance(error, IndexError):
                assert str(got.value) == str(error), what
            assert f"f{len(LAYOUTS[layout]) - 1}" in str(got.value) and str(value) in str(got.value), what
            assert offloaded.cache.pinned_tickets == (), what
            continue
        # inside the buffer (another shard's row): read as the in-memory lookup reads it
        assert torch.equal(offloaded(ids, offsets, bags), want), what


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_host_sync_a_training_step(layout, validation):
    validation(True)
    # two batches in flight (<= 36 distinct rows each) fit the cache: no growth, which syncs (rare)
    memory, offloaded = _lookups(layout, 0.2)
    steps = [_batch(layout, step) for step in range(8)]
    loss_weight = torch.arange(1.0, DIM + 1)

    def train(lookup, step, prefetch):
        ids, offsets, bags = steps[step]
        out = lookup(ids, offsets, bags)
        if prefetch:
            lookup.prefetch(*steps[step + 1])
        out.mul(loss_weight).sum().backward()
        return out

    for step in range(4):  # warm: the cache evicts every step from here on
        assert torch.equal(train(offloaded, step, True), train(memory, step, False)), step
    # the pure-torch CPU kernels sync themselves (unique_consecutive in the backward; the GPU's Triton
    # kernels do not): there, the offloaded step syncs as often as the in-memory one
    native = select_backend(memory.weight, steps[0][0]) == "native"
    for step in range(4, 7):
        with DispatchCounts() as counts:
            out = train(offloaded, step, True)
        with DispatchCounts() as in_memory:
            want = train(memory, step, False)
        assert torch.equal(out, want), step
        assert counts.syncs == in_memory.syncs, (step, dict(counts.sync_ops), dict(in_memory.sync_ops))
        if native:
            assert counts.syncs == 1, (step, dict(counts.sync_ops))  # the acquire's; in memory: its id check
    assert offloaded.cache.counters.evictions > 0 and offloaded.cache.size == offloaded.cache.capacity


def test_a_prefetch_matches_other_views_of_its_ids_without_reading_them():
    from shardkit.modules.offload_prefetch import PrefetchedRows

    batch = torch.arange(40)
    ids, offsets = batch[10:30], torch.arange(0, 21, 4)
    record = PrefetchedRows(ids, offsets, None, lambda: None, background=False)
    with DispatchCounts() as counts:
        assert record.matches(batch[10:30], offsets.view(-1), None)  # new views, same memory
    assert counts.syncs == 0, dict(counts.sync_ops)
    with DispatchCounts() as counts:  # a copy: compared by value
        assert record.matches(batch[10:30].clone(), offsets, None)
        assert not record.matches(batch[11:31], offsets, None)
    assert counts.sync_ops["aten::equal"] == 2
    batch[12] = 99  # written since the prefetch (its rows were acquired for the old values)
    assert not record.matches(batch[10:30], offsets, None) and not record.matches(ids, offsets, None)


class _Stream:
    """A stand-in for torch.cuda.Stream: equal by name; records what it waited for."""

    def __init__(self, name: str) -> None:
        self.name, self.waited = name, []

    def __eq__(self, other) -> bool:
        return isinstance(other, _Stream) and other.name == self.name

    def __repr__(self) -> str:
        return f"<stream {self.name}>"

    def wait_stream(self, other) -> None:
        self.waited.append(other.name)


def test_the_stream_rule(monkeypatch):
    """``_bind_stream`` with stand-in streams: the first call binds; another stream while a ticket
    is pinned is an error naming both and the fix; with nothing pinned it takes over after a wait."""
    cache = RowCache({"w": torch.zeros(8, 2)}, 4, bookkeeping="device")
    current = {"stream": _Stream("a")}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    cache._book_device = torch.device("cuda")  # only _bind_stream reads it in this test
    cache._bind_stream("acquire")
    assert cache._stream == _Stream("a")
    cache._tickets[0] = torch.zeros(0, dtype=torch.int64)  # a ticket in flight
    current["stream"] = _Stream("b")
    pattern = r"one CUDA stream.*tickets \[0\].*stream a.*stream b.*torch.cuda.stream"
    with pytest.raises(RuntimeError, match=pattern):
        cache._bind_stream("release")
    current["stream"] = _Stream("a")
    cache._bind_stream("release")  # the acquiring stream: fine
    del cache._tickets[0]
    current["stream"] = _Stream("b")
    cache._bind_stream("acquire")  # nothing pinned: b takes over, after a's queued ops
    assert cache._stream == _Stream("b") and current["stream"].waited == ["a"]
