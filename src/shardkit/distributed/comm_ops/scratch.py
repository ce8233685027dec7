"""Large CPU receive / output buffers kept across steps and handed out again once provably free.

Why: a training step allocates the same multi-MiB buffers every step (the all-to-all's receive
buffer, the pooled output, the reduce-scatter's sum, the gradient's send buffer, the lookups' outputs:
``modules.lookup_kernels.lookup_output``). Torch's CPU
allocator hands sizes past glibc's mmap threshold back to the OS when they are freed, so each fresh
buffer is fresh pages that the first write faults in and zeroes one by one (a 32 MiB buffer: ~12 ms
of CPU on one core, against ~1.3 ms to write it again), on the main thread or on the gloo thread
that receives into it, which competes with the ranks' main threads for the cores.

``take(nbytes, device)`` -> a ``uint8 [nbytes]`` buffer; ``empty(shape, dtype, device)`` /
``new_empty(like, *shape)`` -> a tensor of that shape and dtype over one; ``cat(tensors)`` a 1-D
concatenation into one. Contents are undefined, as ``torch.empty``'s. A CPU request of at least
:data:`MIN_BYTES` is served from a kept buffer of its size class (``nbytes`` rounded up to
:data:`GRANULE`) when one is **free**: nothing but this pool holds its storage (the storage's C++ use
count is the pool's own reference alone, and no Python object holds the pool's storage object). A buffer
that anything still refers to (the caller's output held by the user, autograd's saved tensors, a
gradient stolen into ``.grad``, a view, a ``numpy()`` array, a collective's work) is never handed out
again; otherwise a new buffer is allocated (``huge_pages.empty``) and kept. A collective's buffers stay
in use a moment after its ``wait()`` returns (gloo's worker thread drops its reference to the work then,
milliseconds later on a busy machine): a request in that moment gets a new buffer, kept from then on.
No caller gives a buffer back: dropping every reference to it is what frees it. Each handed-out
tensor is made with ``set_`` on the storage (no view of a pool tensor), so holding it or anything
made from it holds the storage.

At most :data:`MAX_KEPT` buffers of :data:`MAX_KEPT_BYTES` in all (a single larger one alone) are kept,
the most recently handed out; a forgotten one lives on while its user holds it, then goes back to the
allocator. ``clear()`` forgets them all. Requests below :data:`MIN_BYTES`, off the CPU (a GPU's caching
allocator already reuses its memory), under a dispatch mode (fake tensors) or a compiler's trace, or
with the pool switched off are plain new buffers: ``set_recv_buffers(False)`` at run time or
``SHARDKIT_RECV_BUFFERS=0`` (also ``false``, ``no``, ``off``; read at import). Thread-safe (a buffer is
checked and handed out under one lock).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Dict, List, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode

from shardkit import huge_pages
from shardkit.distributed.state import register_reset

ENV_VAR = "SHARDKIT_RECV_BUFFERS"
MAX_KEPT = 16
# what free kept buffers may hold on to between steps at most (a step's own buffers, in use, count too)
MAX_KEPT_BYTES = 1 << 30
# below this a fresh allocation is cheap (the allocator's heap reuses it): not worth holding on to
MIN_BYTES = 1 << 20
# size classes: requests that differ by less (uneven batches of a few rows) share buffers
GRANULE = 64 << 10

_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


# the storage's C++ use count (a private torch binding): without it "free" cannot be proven, so a torch
# that lacks it gets plain new buffers
_SUPPORTED = hasattr(torch._C, "_storage_Use_Count")


def _default_from_env() -> bool:
    return _SUPPORTED and os.environ.get(ENV_VAR, "1").strip().lower() not in _FALSE_WORDS


_ENABLED = [_default_from_env()]


class _Kept:
    """One kept buffer: its storage, and the Python references to the storage object that mean
    "only the pool" (measured when it was made, when nothing else could hold it)."""

    __slots__ = ("storage", "nbytes", "device", "own_refs")

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes, self.device = nbytes, device
        # no local name for it: the count below is the pool's reference alone, as in free()
        self.storage = huge_pages.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        self.own_refs = sys.getrefcount(self.storage)

    def free(self) -> bool:
        # use count 1: the storage object the pool holds is the storage's only owner (every tensor
        # over it, a saved one, a view, a work's, adds one); the Python count: nobody else took
        # that very storage object (``tensor.untyped_storage()`` returns it while it lives)
        return (
            torch._C._storage_Use_Count(self.storage._cdata) == 1
            and sys.getrefcount(self.storage) == self.own_refs
        )


_kept: List[_Kept] = []  # least recently handed out first
# requests served from a kept buffer / by a new kept one, since import or the last clear()
_counts = {"reused": 0, "new": 0}
_CPU = torch.device("cpu")
_lock = threading.Lock()


def set_recv_buffers(enabled: bool) -> None:
    """Switch the kept buffers on or off for this process (off: every request is a new buffer; the
    kept ones are forgotten)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_recv_buffers expects a bool, got {type(enabled).__name__}")
    if enabled and not _SUPPORTED:
        raise RuntimeError(
            f"kept receive buffers need torch._C._storage_Use_Count, which torch {torch.__version__} "
            "lacks; leave them off (set_recv_buffers(False) / SHARDKIT_RECV_BUFFERS=0)"
        )
    _ENABLED[0] = enabled
    if not enabled:
        clear()


def recv_buffers_enabled() -> bool:
    """Whether large CPU buffers are kept and reused (default on; see the module doc)."""
    return _ENABLED[0]


def _size_class(nbytes: int) -> int:
    return -(-nbytes // GRANULE) * GRANULE


def _free_storage(nbytes: int, device: torch.device) -> torch.UntypedStorage:
    """A free kept storage of ``nbytes``' size class on ``device``, else a new one, kept."""
    size = _size_class(nbytes)
    with _lock:
        for i, kept in enumerate(_kept):
            if kept.nbytes == size and kept.device == device and kept.free():
                _kept.append(_kept.pop(i))
                _counts["reused"] += 1
                return kept.storage
        _counts["new"] += 1
        _kept.append(_Kept(size, device))
        while len(_kept) > MAX_KEPT or (len(_kept) > 1 and kept_bytes() > MAX_KEPT_BYTES):
            del _kept[0]
        return _kept[-1].storage


def empty(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """A contiguous ``shape`` tensor of ``dtype`` on ``device`` (None: the CPU), contents undefined:
    over a kept buffer when it is a large CPU one (module doc), else ``huge_pages.empty``'s."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes < MIN_BYTES:  # also below huge_pages.MIN_BYTES: nothing to advise
        return torch.empty(shape, dtype=dtype, device=device)
    device = _CPU if device is None else torch.device(device)
    # under a dispatch mode (fake tensors of torch.export) or a compiler's trace the buffer would not
    # be real memory: such a request is never kept
    if (
        device.type != "cpu"
        or not _ENABLED[0]
        or _dispatch_mode() is not None
        or torch.compiler.is_compiling()
    ):
        return huge_pages.empty(*shape, dtype=dtype, device=device)
    # set_ rather than a view of a pool tensor: the result holds the storage itself, nothing of ours
    return torch.empty(0, dtype=dtype).set_(_free_storage(nbytes, device), 0, tuple(shape))


def new_empty(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """``like.new_empty(*shape)`` (``like``'s dtype and device), from :func:`empty`."""
    return empty(shape, like.dtype, like.device)


def cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` of 1-D tensors of one dtype (at least one), into a buffer of
    :func:`empty` when it is large (below :data:`MIN_BYTES` a plain ``torch.cat``: ``out=`` costs a
    few us more)."""
    numel = sum(t.numel() for t in tensors)
    first = tensors[0]
    if numel * first.element_size() < MIN_BYTES:
        return torch.cat(list(tensors))
    return torch.cat(list(tensors), out=empty((numel,), first.dtype, first.device))


def take(nbytes: int, device) -> torch.Tensor:
    """A ``uint8 [nbytes]`` buffer on ``device`` (None: the CPU), contents undefined."""
    return empty((nbytes,), torch.uint8, device)


def clear() -> None:
    """Forget every kept buffer (each goes back to the allocator once its users drop it) and zero
    the :func:`counts`."""
    with _lock:
        _kept.clear()
        _counts.update(reused=0, new=0)


def counts() -> Dict[str, int]:
    """``{"reused": requests served from a kept buffer, "new": requests that made one}`` (requests
    the pool serves only: large CPU ones while it is on), since import or the last :func:`clear`."""
    return dict(_counts)


def kept_bytes() -> int:
    """Bytes of the buffers kept (free or in use)."""
    return sum(kept.nbytes for kept in _kept)


def _reset_to_default() -> None:
    _ENABLED[0] = _default_from_env()
    clear()


register_reset("comm_ops.scratch", _reset_to_default)


__all__ = [
    "ENV_VAR",
    "GRANULE",
    "MAX_KEPT",
    "MAX_KEPT_BYTES",
    "MIN_BYTES",
    "cat",
    "clear",
    "counts",
    "empty",
    "kept_bytes",
    "new_empty",
    "recv_buffers_enabled",
    "set_recv_buffers",
    "take",
]
