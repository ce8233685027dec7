"""Storage tiers behind the embedding lookup: tables kept in a slower, larger memory (offloading).

- :mod:`~shardkit.kernels.offload.backing_store`: the slow tier, a mapped file per shard (CPU) or pinned
  host memory (CUDA);
- :mod:`~shardkit.kernels.offload.row_cache`: the fast tier, a cache of hot rows with LRU / LFU
  replacement and dirty write-back;
- :class:`OffloadSpec`: what a lookup was asked for (from the plan's compute kernel and cache params).

The modules above only choose a tier; the kernels run unchanged on the rows they are given, which is why
an offloaded table trains bitwise like an in-memory one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

OFFLOAD_KINDS = ("uvm", "caching")
CACHE_ALGORITHMS = ("lru", "lfu")


@dataclass(frozen=True)
class OffloadSpec:
    """How one table shard is offloaded.

    kind: ``"uvm"`` (every lookup reads the slow tier: ``fused_uvm``) or ``"caching"`` (a cache of
        ``load_factor x rows`` rows in the fast tier: ``fused_uvm_caching``).
    load_factor: share of the shard's rows the cache keeps, in (0, 1] (caching only).
    algorithm: ``"lru"`` or ``"lfu"`` replacement (caching only).
    directory: where the backing file goes (None: ``$SHARDKIT_OFFLOAD_DIR`` or a temporary directory).
    prefetch: a prefetching pipeline loads the next batch's rows during the current step.
    """

    kind: str = "caching"
    load_factor: float = 0.2
    algorithm: str = "lru"
    directory: Optional[str] = None
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.kind not in OFFLOAD_KINDS:
            raise ValueError(f"offload kind must be one of {OFFLOAD_KINDS}, got {self.kind!r}")
        if self.algorithm not in CACHE_ALGORITHMS:
            raise ValueError(f"cache algorithm must be one of {CACHE_ALGORITHMS}, got {self.algorithm!r}")
        if not 0.0 < self.load_factor <= 1.0:
            raise ValueError(f"cache load factor must be in (0, 1], got {self.load_factor}")

    def cache_rows(self, num_rows: int) -> int:
        """Rows the cache keeps between steps for a shard of ``num_rows`` rows (0 for ``uvm``)."""
        if self.kind == "uvm":
            return 0
        return max(1, min(num_rows, int(round(self.load_factor * num_rows))))


__all__ = ["CACHE_ALGORITHMS", "OFFLOAD_KINDS", "OffloadSpec"]
