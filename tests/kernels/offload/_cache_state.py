"""A check shared by the row-cache lockstep tests: two caches in exactly the same state."""

from __future__ import annotations

import torch

from shardkit.kernels.offload.row_cache import RowCache


def assert_same_state(a: RowCache, b: RowCache) -> None:
    """The same maps, recency, frequency, pins and dirty flags, buffers, backing and counters."""
    for name in ("row_of_slot", "slot_of_row", "_pins", "_dirty", "_stamp", "_freq"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name
        assert torch.equal(a.backing[name], b.backing[name]), name
    assert vars(a.counters) == vars(b.counters)
