"""A fixed ``malloc`` mmap threshold for processes that hold offloaded tables (glibc only).

Why: glibc's ``malloc`` serves a request of at least its *mmap threshold* with a fresh mapping that
``free`` unmaps at once, and smaller ones from its heap, whose free top it returns to the system only
beyond a *trim threshold*. Both thresholds are dynamic: freeing a mapped block of n bytes raises the
mmap threshold to n (up to 32 MiB) and the trim threshold to 2n (up to 64 MiB). So after a process once
freed a large block (an earlier test in a reused worker, a 32 MiB temporary), the 16 MiB pieces a
checkpoint load reads come from the heap and their freed memory stays resident: the load's peak
resident set measured 31-80 MiB for the same load, and its data segment grew by up to 64 MiB (beyond a
``RLIMIT_DATA`` cap that fits the pieces), depending only on the process's history. A training step of
a table 10x the memory budget kept ~40 MiB of freed batch temporaries resident the same way.

:func:`fix_malloc_thresholds` (called when a file-backed store is created or opened) sets both
thresholds to :data:`DEFAULT_THRESHOLD` (``mallopt``, which also turns the dynamic adjustment off):
every block of 4 MiB or more is mapped and unmapped on its own, and a free heap top beyond 4 MiB is
returned, so the resident set of a checkpoint or a step is what is live, whatever ran before.
``SHARDKIT_MALLOC_THRESHOLD`` (bytes; ``0`` / ``off``) chooses another value or leaves ``malloc``
alone. A no-op off glibc (other allocators return large blocks anyway).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from typing import Optional

MALLOC_THRESHOLD_ENV = "SHARDKIT_MALLOC_THRESHOLD"
# 4 MiB: a 1 MiB threshold kept a 10x-budget table's step within its budget (58.7 MiB peak for 64) but
# made every step of the process, in-memory tables' included, 2-3x slower (fresh mappings and page
# faults for each 1-4 MiB temporary: `fused` 20.9 ms against 7.2 ms with malloc left alone, idle
# machine, benchmarks/offload.py); at 4 MiB `fused` took 7.9 ms and that run's peak was 69.8 MiB.
# Checkpoint pieces (16 MiB) are mapped and returned at either value. Tighter: SHARDKIT_MALLOC_THRESHOLD.
DEFAULT_THRESHOLD = 4 << 20
# glibc's mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_lock = threading.Lock()
_applied: Optional[int] = None


def configured_threshold() -> int:
    """The threshold in bytes from ``SHARDKIT_MALLOC_THRESHOLD`` (0: leave malloc alone); ValueError
    naming the variable for a value that is not a byte count."""
    raw = os.environ.get(MALLOC_THRESHOLD_ENV, "").strip().lower()
    if raw in ("", "default"):
        return DEFAULT_THRESHOLD
    if raw in ("0", "off", "no", "false"):
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MALLOC_THRESHOLD_ENV}={raw!r}: expected a byte count or 'off'") from None
    if value < 0:
        raise ValueError(f"{MALLOC_THRESHOLD_ENV}={raw!r}: expected a byte count >= 0 or 'off'")
    return value


def fix_malloc_thresholds() -> int:
    """Set glibc's mmap and trim thresholds once per process (see the module docstring); returns the
    threshold in effect (0 when left alone: another C library, or switched off)."""
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        threshold = configured_threshold()
        if threshold and platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
            if mallopt is None or not (
                mallopt(_M_MMAP_THRESHOLD, threshold) and mallopt(_M_TRIM_THRESHOLD, threshold)
            ):
                threshold = 0
        else:
            threshold = 0
        _applied = threshold
        return threshold


__all__ = ["DEFAULT_THRESHOLD", "MALLOC_THRESHOLD_ENV", "configured_threshold", "fix_malloc_thresholds"]
