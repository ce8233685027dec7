"""What a row cache did: lookups, hits, misses, evictions, rows and bytes moved (L0)."""

from __future__ import annotations

import dataclasses
from typing import Dict


@dataclasses.dataclass
class CacheCounters:
    """What a :class:`RowCache` did since it was built or last :meth:`reset`.

    ``lookups``: rows requested by :meth:`RowCache.acquire` (each acquire counts each of its distinct rows
    once); ``hits`` / ``misses``: of those, the rows already cached / loaded from the backing store;
    ``evictions``: rows dropped from the cache to make room or when shrinking back to capacity (not by
    :meth:`RowCache.invalidate`); ``rows_read`` / ``bytes_read``: rows copied from the backing store;
    ``rows_written`` / ``bytes_written``: dirty rows written back to it (eviction, shrink, flush). A row's
    bytes are the sum over the backing fields of ``element_size * prod(width)``.
    """

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rows_read: int = 0
    rows_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / lookups``; 0.0 before the first lookup."""
        return self.hits / self.lookups if self.lookups else 0.0

    def reset(self) -> None:
        """Set every count back to 0."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)

    def as_dict(self) -> Dict[str, float]:
        """Every count by name, plus ``hit_rate``."""
        counts: Dict[str, float] = dict(dataclasses.asdict(self))
        counts["hit_rate"] = self.hit_rate
        return counts


__all__ = ["CacheCounters"]
