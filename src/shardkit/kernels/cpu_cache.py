"""This CPU's data-cache sizes, and the block sizes the CPU loss kernels derive from them.

Block sizes of streaming kernels are chosen from the cache they must fit, read from the machine, never
tuned to one CPU: a block tuned on one cache size (4 MiB of fp32 per block, sized on a CPU where it
sat in L3) ran the vocab-parallel cross-entropy's backward at 0.6x Megatron's speed on a CPU with
another cache hierarchy.

Sources, in order: the ``SHARDKIT_CPU_CACHES`` variable when set (e.g. ``"l1d=32K,l2=512K"``: an
override for a machine that reports wrong sizes, and how ``benchmarks/ce_cache_sensitivity.py``
emulates other CPUs' block choices; a key left out is detected), Linux sysfs
(``/sys/devices/system/cpu/cpu0/cache/index*/{level,type,size}``), then ``sysconf``
(``SC_LEVEL1_DCACHE_SIZE`` / ``SC_LEVEL2_CACHE_SIZE``, by glibc's numbers where CPython lacks the names:
glibc asks CPUID, which also answers in a container or VM without the sysfs cache entries, e.g. an AMD
guest without ``topoext``), then :data:`FALLBACK` (32 KiB L1d, 1 MiB L2: at or below the per-core
caches of every x86 server CPU of the last decade, so a fallback block is never too large for the
cache, only possibly smaller than best). A detected pair whose L2 is smaller than its L1d (no real
CPU's per-core hierarchy) is not used: the next source answers. The sizes are read once per process
(:func:`cache_sizes`). ``lscpu`` is not read: its summary gives each level's total over all instances
("L2 cache: 4 MiB (2 instances)" on a 2-core VM with 2 MiB per core), not the per-core size.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

SYSFS_CACHE = "/sys/devices/system/cpu/cpu0/cache"
OVERRIDE_ENV = "SHARDKIT_CPU_CACHES"


@dataclass(frozen=True)
class CacheSizes:
    """Per-core data-cache sizes in bytes and where they came from ("sysfs", "sysconf", "fallback", or
    ``SHARDKIT_CPU_CACHES``)."""

    l1d: int
    l2: int
    source: str


FALLBACK = CacheSizes(l1d=32 * 1024, l2=1024 * 1024, source="fallback")


def parse_size(text: str) -> Optional[int]:
    """Bytes from a sysfs size such as ``"48K"``, ``"2048K"``, ``"2M"`` or ``"512"``; None if invalid."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in ("K", "M", "G") else text
    if not digits.isdigit():
        return None
    value = int(digits) * scale
    return value if value > 0 else None


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def sysfs_cache_sizes(root: str = SYSFS_CACHE) -> Optional[CacheSizes]:
    """The L1 data and L2 sizes from sysfs under ``root``, or None when either is missing or invalid."""
    found = {}
    base = Path(root)
    try:
        entries = sorted(base.glob("index*"))
    except OSError:
        return None
    for entry in entries:
        level, kind, size = (_read(entry / name) for name in ("level", "type", "size"))
        if level is None or kind is None or size is None:
            continue
        level, kind, value = level.strip(), kind.strip(), parse_size(size)
        if value is None or kind not in ("Data", "Unified"):
            continue
        found.setdefault(level, value)
    if "1" not in found or "2" not in found:
        return None
    return _plausible(CacheSizes(l1d=found["1"], l2=found["2"], source="sysfs"))


def _plausible(sizes: CacheSizes) -> Optional[CacheSizes]:
    # an L2 below the L1d is no CPU's per-core hierarchy (a hypervisor's or a parser's error): not used
    return sizes if sizes.l2 >= sizes.l1d else None


# glibc's numbers for the two names (an enum in <bits/confname.h>, the same on every Linux architecture).
# CPython's os.sysconf_names lacks them (seen in CPython 3.11.7 here): os.sysconf by name raises
# ValueError there, so without the numbers this source never answered
GLIBC_SYSCONF = {"SC_LEVEL1_DCACHE_SIZE": 188, "SC_LEVEL2_CACHE_SIZE": 191}


def _is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


def sysconf_cache_sizes() -> Optional[CacheSizes]:
    """The sizes from ``sysconf`` (glibc asks CPUID on x86), or None when unavailable or 0.

    By name where Python knows it, else by glibc's number on glibc (:data:`GLIBC_SYSCONF`); elsewhere
    (musl, macOS) None.
    """
    names = getattr(os, "sysconf_names", {})
    glibc = None
    sizes = []
    for name in ("SC_LEVEL1_DCACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        code = name if name in names else None
        if code is None:
            glibc = _is_glibc() if glibc is None else glibc
            if not glibc:
                return None
            code = GLIBC_SYSCONF[name]
        try:
            sizes.append(os.sysconf(code))
        except (ValueError, OSError, AttributeError):
            return None
    l1d, l2 = sizes
    if l1d <= 0 or l2 <= 0:
        return None
    return _plausible(CacheSizes(l1d=int(l1d), l2=int(l2), source="sysconf"))


def override_sizes(text: str) -> dict[str, int]:
    """``{"l1d": bytes, "l2": bytes}`` (either key may be absent) from a ``SHARDKIT_CPU_CACHES`` value
    such as ``"l1d=32K,l2=512K"`` (keys case-insensitive, sizes as sysfs writes them or ``M``).
    Raises ValueError naming the variable and the part that is wrong."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        size = parse_size(value) if sep else None
        if key not in ("l1d", "l2") or size is None:
            raise ValueError(
                f"{OVERRIDE_ENV}={text!r}: {part!r} is not l1d=SIZE or l2=SIZE with SIZE > 0 such as "
                "48K, 2048K, 2M or a byte count"
            )
        if key in sizes:
            raise ValueError(f"{OVERRIDE_ENV}={text!r}: {key} is given twice")
        sizes[key] = size
    if not sizes:
        raise ValueError(f"{OVERRIDE_ENV}={text!r}: names no size (e.g. l1d=32K,l2=512K)")
    return sizes


def detected_cache_sizes() -> CacheSizes:
    """The machine's own sizes: sysfs, then sysconf, then :data:`FALLBACK` (no override)."""
    return sysfs_cache_sizes() or sysconf_cache_sizes() or FALLBACK


@functools.cache
def cache_sizes() -> CacheSizes:
    """This process's per-core L1d and L2 sizes: ``SHARDKIT_CPU_CACHES`` where set (a key it leaves out
    is detected), else :func:`detected_cache_sizes`. Read once; ``cache_sizes.cache_clear()`` re-reads.
    """
    text = os.environ.get(OVERRIDE_ENV, "").strip()
    if not text:
        return detected_cache_sizes()
    given = override_sizes(text)
    base = detected_cache_sizes() if len(given) < 2 else FALLBACK
    return CacheSizes(l1d=given.get("l1d", base.l1d), l2=given.get("l2", base.l2), source=OVERRIDE_ENV)


def last_level_cache_bytes(root: str = SYSFS_CACHE) -> int:
    """The largest CPU cache's size in bytes (sysfs: the L3 where there is one), or 32 MiB when sysfs
    does not say (callers only size a working set from it, e.g. kernels/prefetch.py's measurement)."""
    sizes = [parse_size(_read(index / "size") or "") for index in Path(root).glob("index*")]
    return max([size for size in sizes if size], default=32 << 20)


def rows_in_cache(row_bytes: int, cache_bytes: int, limit: int) -> int:
    """How many rows of ``row_bytes`` of working set (all buffers a block touches per row) fit half of
    ``cache_bytes``, at least 1 and at most ``limit``. Half: the other half holds what streams past
    (the next block's source, the statistics, the stack), so the block is not evicted between steps.
    """
    rows = (cache_bytes // 2) // max(1, row_bytes)
    return max(1, min(max(1, limit), rows))


def columns_in_cache(item_bytes: int, cache_bytes: int, minimum: int = 256) -> int:
    """Columns per chunk for a kernel that reads a chunk of one row twice (its max, then its exp-sum):
    half of ``cache_bytes`` (the L1d) of ``item_bytes`` elements, at least ``minimum``, a multiple of 64.
    """
    columns = (cache_bytes // 2) // max(1, item_bytes)
    return max(minimum, columns // 64 * 64)


__all__ = [
    "FALLBACK",
    "GLIBC_SYSCONF",
    "OVERRIDE_ENV",
    "CacheSizes",
    "cache_sizes",
    "columns_in_cache",
    "detected_cache_sizes",
    "last_level_cache_bytes",
    "override_sizes",
    "parse_size",
    "rows_in_cache",
    "sysconf_cache_sizes",
    "sysfs_cache_sizes",
]
