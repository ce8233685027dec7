"""RowCache used from two threads (kernels/offload/row_cache.py, "Threads"): a background acquire (the
prefetch of batch i+1) while the main thread updates the rows of its pinned ticket in place and releases
it (batch i's backward).

- a release while another thread is inside the cache is queued, not waited for; the ticket's rows stay
  pinned (never victims) until it is applied, and its dirty rows are written back when evicted later;
- a growth of the buffers in another thread waits for a kernel holding ``buffers_in_use``, so an
  in-place update of a pinned row is never lost in a dropped buffer;
- two threads acquiring, updating in place and releasing random rows of their own ranges under
  eviction pressure (growth, shrinking, write-back) end with the backing store equal to the reference.

Each waits with a bounded join, so a lock taken in the wrong order fails the test instead of hanging it.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from shardkit.kernels.offload.row_cache import RowCache

JOIN_S = 30.0


def _backing(num_rows: int):
    return {"weight": torch.zeros(num_rows, 4), "state": torch.zeros(num_rows)}


class _GatedCache(RowCache):
    """A RowCache whose loads wait for ``gate`` once it is cleared (inside the cache's lock, as a slow
    read would); ``loading`` is set when a load starts."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.loading = threading.Event()

    def _load(self, rows, slots) -> None:
        self.loading.set()
        assert self.gate.wait(JOIN_S), "the gate was never opened"
        super()._load(rows, slots)


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - re-raised by the test
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _joined(thread, out):
    thread.join(JOIN_S)
    assert not thread.is_alive(), "a thread did not finish (lock order?)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_release_during_a_background_acquire_is_queued_and_keeps_its_rows_pinned():
    cache = _GatedCache(_backing(10), 2, algorithm="lru")
    ticket, slots = cache.acquire(torch.tensor([0, 1]))
    with cache.buffers_in_use():  # batch i's backward: update its rows in place
        cache.tensors["weight"].index_fill_(0, slots, 7.0)
    cache.gate.clear()
    cache.loading.clear()  # set by the acquire above
    worker = _in_thread(lambda: cache.acquire(torch.tensor([2, 3])))  # batch i+1's prefetch
    assert cache.loading.wait(JOIN_S)
    # the worker holds the cache (its read is slow): the release must not wait for it
    releaser = _in_thread(lambda: cache.release(ticket, dirty=True))
    _joined(*releaser)
    assert cache._deferred == [(ticket, True)]
    cache.gate.set()
    prefetched, _ = _joined(*worker)
    # rows 0 and 1 were pinned while the worker chose its slots: kept, the buffers grew instead
    assert cache.size == 4
    assert cache.resident_rows().tolist() == [0, 1, 2, 3]  # applies the queued release first
    assert cache.pinned_tickets == (prefetched,)
    cache.release(prefetched, dirty=False)  # nothing pinned: shrinks to 2 rows, evicting 0 and 1
    assert cache.resident_rows().tolist() == [2, 3]
    assert torch.equal(cache.backing["weight"][:2], torch.full((2, 4), 7.0))  # written back on eviction


def test_growth_in_another_thread_waits_for_a_kernel_using_the_buffers():
    cache = RowCache(_backing(10), 2, algorithm="lru")
    ticket, slots = cache.acquire(torch.tensor([0, 1]))
    with cache.buffers_in_use():
        weight = cache.tensors["weight"]
        # the prefetch needs two more slots while 0 and 1 are pinned: the buffers must grow
        worker = _in_thread(lambda: cache.acquire(torch.tensor([2, 3])))
        worker[0].join(0.5)
        assert worker[0].is_alive(), "the buffers were reallocated while a kernel was using them"
        weight.index_fill_(0, slots, 5.0)  # the kernel's in-place update, after the worker started
    prefetched, _ = _joined(*worker)
    cache.release(ticket, dirty=True)
    cache.release(prefetched, dirty=False)
    cache.flush()
    assert torch.equal(cache.backing["weight"][:2], torch.full((2, 4), 5.0))


def _hammer(cache: RowCache, lo: int, hi: int, rounds: int, seed: int, counts: torch.Tensor) -> None:
    """Acquire random rows of [lo, hi), add 1 to them in place, release dirty; count in ``counts``."""
    rng = random.Random(seed)
    for _ in range(rounds):
        rows = torch.tensor(sorted(rng.sample(range(lo, hi), rng.randint(1, 6))))
        ticket, slots = cache.acquire(rows)
        with cache.buffers_in_use():
            cache.tensors["weight"].index_add_(0, slots, torch.ones(slots.numel(), 4))
            cache.tensors["state"].index_add_(0, slots, torch.ones(slots.numel()))
        counts.index_add_(0, rows, torch.ones(rows.numel()))
        cache.release(ticket, dirty=True)


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_two_threads_under_eviction_pressure_lose_no_update(algorithm):
    cache = RowCache(_backing(40), 4, algorithm=algorithm)
    counts = [torch.zeros(40), torch.zeros(40)]  # one per thread
    other = _in_thread(lambda: _hammer(cache, 20, 40, 300, 1, counts[1]))
    _hammer(cache, 0, 20, 300, 2, counts[0])
    _joined(*other)
    assert cache.pinned_tickets == ()
    cache.flush()
    total = counts[0] + counts[1]
    assert torch.equal(cache.backing["weight"], total[:, None].expand(40, 4))
    assert torch.equal(cache.backing["state"], total)
    assert cache.size == 4
