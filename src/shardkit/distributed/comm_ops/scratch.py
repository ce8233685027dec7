"""Receive buffers reused across calls: a reduce-scatter's all-to-all receive buffer is scratch (the
ranks' pieces are summed into a new tensor), so the next call of the same size can receive into it.

Why: a fresh buffer of tens of MiB is fresh pages, which the first write faults in one by one (a
32 MiB buffer: ~12 ms of CPU to fault and zero on one core, against ~1.3 ms to write it again); the
gloo thread that receives into it competes with the ranks' main threads for the cores. Torch's CPU
allocator hands back such sizes to the OS (glibc's mmap threshold), so it does not keep them.

``take(nbytes, device)`` -> a ``uint8 [nbytes]`` buffer, a kept one when one of that size and device
is free, else a new one; ``give_back(buffer)`` keeps it for the next ``take`` (after the collective
that wrote it has completed and its contents were consumed). A buffer taken and never given back (an
error between the two) is only garbage. At most ``MAX_KEPT`` buffers are kept, the most recently
given back; ``clear()`` drops them all. A buffer is handed out once even with several threads
(``take`` pops it from the dict in one step).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Tuple

import torch

from shardkit import huge_pages

MAX_KEPT = 4
# below this a fresh allocation is cheap (the allocator's heap reuses it): not worth holding on to
MIN_BYTES = 1 << 20

_kept: OrderedDict[Tuple[int, str], torch.Tensor] = OrderedDict()


def take(nbytes: int, device: torch.device) -> torch.Tensor:
    """A ``uint8 [nbytes]`` buffer on ``device`` whose contents are undefined (kept or new)."""
    buffer = _kept.pop((nbytes, str(device)), None)
    if buffer is None:
        buffer = huge_pages.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer


def give_back(buffer: torch.Tensor) -> None:
    """Keep ``buffer`` (from :func:`take`, no longer read or written) for a later :func:`take`; only
    a CPU buffer is kept (a GPU's caching allocator already reuses its memory without faults)."""
    if buffer.numel() < MIN_BYTES or buffer.device.type != "cpu":
        return
    key = (buffer.numel(), str(buffer.device))
    _kept.pop(key, None)
    _kept[key] = buffer
    while len(_kept) > MAX_KEPT:
        _kept.popitem(last=False)


def clear() -> None:
    """Drop every kept buffer (their memory goes back to the allocator)."""
    _kept.clear()


def kept_bytes() -> int:
    """Bytes held by kept buffers."""
    return sum(buffer.numel() for buffer in _kept.values())


__all__ = ["MAX_KEPT", "MIN_BYTES", "clear", "give_back", "kept_bytes", "take"]
