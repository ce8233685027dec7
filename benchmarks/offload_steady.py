"""The steady state of an offloaded table's cache, for ``python -m benchmarks.offload``.

A training run lives for millions of steps in its cache's steady state; a freshly built cache first
misses every row it sees for the first time (the Zipf tail makes that most rows of a step for hundreds
of steps). The benchmark therefore times two phases per cache: the *cold* phase (the first
``--cold-steps`` training steps of an empty cache) and the *steady* phase, after :func:`warm_to_steady`.

:func:`warm_to_steady` drives the table's :class:`~shardkit.kernels.offload.row_cache.RowCache` with
exactly the calls a training step makes to it, without the embedding kernel and its backward (that
is what makes it fast): per batch of the same size and id distribution as the steps (one stream,
the same hot rows), ``cache.acquire_ids(ids)`` (the lookup's ``_acquire_rows`` of a
table-wise table: its buffer rows are its ids) then ``cache.release(ticket, dirty=True)`` (what the
fused backward does: every row a training step touched is dirty, so evictions write back as in
training). Admission, replacement (LRU stamps / LFU counts), pins, write-backs and counters are the
cache's own. Warming runs in windows of doubling length (``--warm-window`` batches first) until the
cache is full and the hit rate of a window differs from the previous window's by less than
``--warm-tolerance`` (absolute), or ``--warm-cap`` batches were drawn. A cache of the whole table never
evicts, so a long run's steady state is every row resident and dirty (touched once each); Zipf ids
reach it only after thousands of steps, so such a cache is first loaded with every row (the same
acquire / dirty release, in row order), then the windows run as for the others. Then
``--warmup`` training steps precede the measured ones, whose hit rate is reported next to the last
warming window's (they agree when the warming reached the state training reaches).

:func:`predicted_miss_rates`: what :class:`~shardkit.sharding.cache_params.CacheStatistics` predicts
for the same stream and load factors (per id looked up: ``misses / ids`` of the cache's counters is the
comparable measured figure; the cache's ``hit_rate`` counts each distinct row of a step once).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Sequence

import torch


def zipf_sampler(num_rows: int, exponent: float, seed: int, stream: int = 0) -> Callable[[int], torch.Tensor]:
    """A function ``n -> int64 [n]`` of ids whose k-th most frequent row has probability ~ k^-exponent.

    The hot rows are spread over the table by a permutation drawn from ``seed``; ``stream`` chooses an
    independent sequence of draws over the same permutation (the same hot rows): stream 0 draws from
    the permutation's generator (as before this option), stream s > 0 from its own.
    """
    ranks = torch.arange(1, num_rows + 1, dtype=torch.float64)
    cdf = torch.cumsum(ranks.pow(-exponent), 0)
    cdf /= cdf[-1].clone()
    gen = torch.Generator().manual_seed(seed)
    permutation = torch.randperm(num_rows, generator=gen)
    if stream:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + stream)

    def sample(n: int) -> torch.Tensor:
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        return permutation[torch.searchsorted(cdf, u).clamp_(max=num_rows - 1)]

    return sample


def counts(cache) -> Dict[str, int]:
    """The cache's counters that a window compares (lookups, hits, misses, rows / bytes moved)."""
    c = cache.counters
    return {"lookups": c.lookups, "hits": c.hits, "misses": c.misses, "bytes_read": c.bytes_read}


def _resident(cache) -> int:
    return int((cache.row_of_slot >= 0).sum())


def cache_step(cache, ids: torch.Tensor) -> None:
    """What one training step of a table-wise table does to its cache, without the kernel: acquire the
    step's distinct rows (``OffloadedEmbeddingLookup._acquire_rows``: its buffer rows are its ids) and
    release them dirty (the fused backward updated them)."""
    ticket, _ = cache.acquire_ids(ids)  # as acquire(torch.unique(ids)): the same rows, pins and stamps
    cache.release(ticket, dirty=True)


def warm_to_steady(cache, sample: Callable[[int], torch.Tensor], ids_per_step: int, args) -> Dict[str, Any]:
    """Drive ``cache`` (a ``RowCache``) as training steps would until its hit rate has converged.

    Args:
        cache: the table's ``RowCache`` (``OffloadedEmbeddingLookup.cache``).
        sample: ``n -> int64 [n]`` ids of the steps' distribution (same hot rows).
        ids_per_step: ids of one training step (bags x pooling).
        args: ``warm_window`` (first window, batches), ``warm_tolerance`` (absolute change of the
            window hit rate), ``warm_cap`` (most batches).
    Returns:
        ``warm_batches``, ``warm_s`` (wall seconds), ``warm_hit_rate`` (the last window's, distinct rows),
        ``warm_converged`` (False: stopped by the cap), ``cache_full``, ``prefilled`` (a cache of the
        whole table: every row loaded first, then the windows).
    """
    start = time.perf_counter()
    prefilled = cache.capacity >= cache.num_rows
    if prefilled:
        # a cache of the whole table never evicts: a long run's steady state is every row resident and
        # dirty (each touched once by a training step), reached by Zipf ids only after thousands of
        # steps (4,080 batches in one run); load it directly, then the windows below confirm it
        for first in range(0, cache.num_rows, ids_per_step):
            rows = torch.arange(first, min(first + ids_per_step, cache.num_rows))
            cache_step(cache, rows)
    window, drawn, previous, converged = max(1, args.warm_window), 0, None, False
    last = float("nan")
    full = False
    while drawn < args.warm_cap:
        size = min(window, args.warm_cap - drawn)
        before = counts(cache)
        for _ in range(size):
            cache_step(cache, sample(ids_per_step))
        drawn += size
        after = counts(cache)
        lookups = after["lookups"] - before["lookups"]
        last = (after["hits"] - before["hits"]) / lookups if lookups else 0.0
        full = _resident(cache) >= min(cache.capacity, cache.num_rows)
        if previous is not None and abs(last - previous) < args.warm_tolerance and full:
            converged = True
            break
        previous = last
        window *= 2
    return {
        "warm_batches": drawn,
        "warm_s": time.perf_counter() - start,
        "warm_hit_rate": last,
        "warm_converged": converged,
        "cache_full": full,
        "prefilled": prefilled,
    }


def predicted_miss_rates(
    sample: Callable[[int], torch.Tensor],
    num_rows: int,
    ids_per_step: int,
    steps: int,
    load_factors: Sequence[float],
) -> Dict[str, Any]:
    """``CacheStatistics.from_ids`` of ``steps`` steps of ``sample``: its expected miss rate (per id) at
    each load factor, the rows the sample informs about (its distinct ids) and the seconds it took."""
    from shardkit.sharding.cache_params import CacheStatistics

    ids: List[torch.Tensor] = [sample(ids_per_step) for _ in range(steps)]
    start = time.perf_counter()
    stats = CacheStatistics.from_ids(ids, num_rows)
    seconds = time.perf_counter() - start
    return {
        "miss": {lf: stats.expected_miss_rate(lf) for lf in load_factors},
        "informed_rows": stats.informed_rows,
        "sample_ids": stats.num_ids,
        "seconds": seconds,
    }


def add_arguments(parser) -> None:
    parser.add_argument("--cold-steps", type=int, default=10, help="timed steps of an empty cache")
    parser.add_argument("--warm-window", type=int, default=16, help="first warming window (batches)")
    parser.add_argument("--warm-tolerance", type=float, default=0.01, help="window hit-rate change to stop")
    parser.add_argument("--warm-cap", type=int, default=4096, help="most warming batches per cache")
    parser.add_argument(
        "--stats-steps", type=int, default=64, help="steps of ids the CacheStatistics prediction samples"
    )


__all__ = ["add_arguments", "cache_step", "counts", "predicted_miss_rates", "warm_to_steady", "zipf_sampler"]
