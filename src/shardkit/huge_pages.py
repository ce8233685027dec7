"""Transparent huge pages for the large CPU buffers a training step allocates fresh every step.

Why: torch's CPU allocator gets an allocation of more than 32 MiB (glibc's largest mmap threshold)
straight from the kernel and gives it back when freed, so a pooled output of 128 MiB that a step
writes is 32k fresh 4 KiB pages, each faulted in and zeroed on its first write: measured on the
2-core development VM (one thread, thread CPU), writing 128 MiB into a fresh buffer took 47-49 ms,
into a reused one 7 ms, and into a fresh one advised ``MADV_HUGEPAGE`` 11.7 ms (64 faults of 2 MiB
instead of 32k). Where the kernel's THP mode is ``madvise`` (the common default) or ``always``, the
advice makes the first write fault in 2 MiB pages; with ``never`` it does nothing. The advice only
changes how the memory is backed: the values, the tensor and its lifetime are untouched.

:func:`empty` allocates like ``torch.empty`` and advises the buffer when it is a CPU buffer of at
least :data:`MIN_BYTES`; :func:`advise` advises an existing one (before anything is written to it).
The native kernels advise their own outputs the same way (``csrc/embedding.cpp``). Switch off with
``SHARDKIT_HUGE_PAGES=0`` (read at import; the native kernels read it at their first call).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Optional, Sequence

import torch

# below this, allocations come from glibc's heap (reused without faults) or are too small to matter
MIN_BYTES = 4 << 20
_PAGE = 4096
_MADV_HUGEPAGE = 14


def _enabled_by_env() -> bool:
    return os.environ.get("SHARDKIT_HUGE_PAGES", "1").strip().lower() not in ("0", "false", "off", "no")


def _load_madvise() -> Optional[object]:
    if not sys.platform.startswith("linux") or not _enabled_by_env():
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def enabled() -> bool:
    """Whether buffers are advised (Linux, ``SHARDKIT_HUGE_PAGES`` not off, libc's madvise found)."""
    return _madvise is not None


def advise(tensor: torch.Tensor) -> torch.Tensor:
    """Advise ``tensor``'s memory (whole 4 KiB pages inside it) to be backed by huge pages; returns it.

    Does nothing for a buffer under :data:`MIN_BYTES`, off the CPU, or when switched off. Call it
    before the first write: pages already faulted in stay as they are. A failed madvise is ignored
    (the memory then stays as it was: the advice is an optimization, never a requirement).
    """
    if _madvise is None or tensor.device.type != "cpu":
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < MIN_BYTES:
        return tensor
    start = tensor.data_ptr()
    first = (start + _PAGE - 1) & ~(_PAGE - 1)
    end = (start + nbytes) & ~(_PAGE - 1)
    if end > first:
        _madvise(first, end - first, _MADV_HUGEPAGE)
    return tensor


def wanted(nbytes: int) -> bool:
    """Whether a fresh buffer of ``nbytes`` is advised (callers skip the ``out=`` forms below it: a
    ``torch.cat(..., out=)`` costs ~5 us more than a plain one, which small steps notice)."""
    return _madvise is not None and nbytes >= MIN_BYTES


def cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` of 1-D tensors of one dtype, into an advised buffer when it is large."""
    numel = sum(t.numel() for t in tensors)
    if not tensors or not wanted(numel * tensors[0].element_size()):
        return torch.cat(list(tensors))
    return torch.cat(list(tensors), out=empty(numel, dtype=tensors[0].dtype, device=tensors[0].device))


def empty(*size, dtype: Optional[torch.dtype] = None, device=None) -> torch.Tensor:
    """``torch.empty(*size, dtype=dtype, device=device)``, advised by :func:`advise`."""
    return advise(torch.empty(*size, dtype=dtype, device=device))


def new_empty(like: torch.Tensor, *size) -> torch.Tensor:
    """``like.new_empty(*size)``, advised by :func:`advise`."""
    return advise(like.new_empty(*size))


__all__ = ["MIN_BYTES", "advise", "cat", "empty", "enabled", "new_empty", "wanted"]
