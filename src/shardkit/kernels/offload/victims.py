"""The row cache's replacement choice on the torch path (L0): which slots to evict first.

The same selection as the native op ``row_cache_victims`` (``csrc/row_cache.cpp``), with the same
arguments, so that :class:`~shardkit.kernels.offload.row_cache.RowCache` calls either.
"""

from __future__ import annotations

import torch


def select_victims(
    candidates: torch.Tensor, stamp: torch.Tensor, freq: torch.Tensor, count: int, lfu: bool
) -> torch.Tensor:
    """The ``count`` slots among ``candidates`` (int64 [n], 0 < count < n) to evict first, as a set.

    ``stamp`` / ``freq``: int64 [C], every slot's last-acquire stamp and acquisitions since loaded.
    LRU (``lfu`` False): the smallest stamps. LFU: the fewest acquisitions, ties by the smallest stamps.
    """
    stamps = stamp[candidates]
    if not lfu:
        # stamps are distinct (each acquired row gets its own), so the choice is unique: the slots
        # stamped at most the count-th smallest stamp (one selection: kthvalue is linear, topk of
        # thousands among a cache of 10^5 slots costs twice as much)
        victims = candidates[stamps <= torch.kthvalue(stamps, count).values]
        if victims.numel() == count:
            return victims
        return candidates[torch.topk(stamps, count, largest=False).indices]  # ties: never expected
    # every slot with fewer acquisitions than the count-th smallest, then the least recent of those
    # tied at that count (two selections: no composite key that could overflow)
    freqs = freq[candidates]
    threshold = torch.kthvalue(freqs, count).values
    below = candidates[freqs < threshold]
    tied = (freqs == threshold).nonzero().flatten()
    rest = count - below.numel()
    oldest = tied[torch.topk(stamps[tied], rest, largest=False).indices]
    return torch.cat([below, candidates[oldest]])


__all__ = ["select_victims"]
