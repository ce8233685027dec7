"""Which backend runs the vocab-parallel cross-entropy's two passes over one rank's logits shard.

``shardkit.losses`` computes per-token statistics of a ``[T, V/tp]`` shard in forward and the softmax
gradient in backward. On CUDA, when ``triton`` imports, the plain loss (no soft-capping, temperature 1,
no label smoothing, no z-loss) runs each pass as one Triton kernel (:mod:`shardkit.kernels.triton_ce`:
one read of the shard per pass). On CPU, fp32 / bf16 logits without soft-capping run the native C++
kernels of ``csrc/cross_entropy.cpp`` (:func:`native_ce_kernels`: one read of the shard for the
statistics, one read and one write for the gradient) when they build on this machine; every other
case (fp16 / fp64, soft-capping, ``SHARDKIT_NATIVE=0``, no compiler) runs the pure-torch blocks of
``shardkit.losses.statistics``. :func:`shardkit.kernels.kernel_backend` forces the choice, as for the
embedding ops ("torch": the pure-torch blocks; "native": the C++ kernels, or a RuntimeError saying why
they cannot run the call).

The native gradient writes into a fresh buffer whose pages the OS maps on first write; how they are
mapped is :func:`gradient_page_mode` (``SHARDKIT_CE_PAGES``: "populate", the default on Linux, maps a
row's pages with one ``madvise(MADV_POPULATE_WRITE)`` call; "touch" faults them one 4 KiB page at a
time, the only way elsewhere and the fallback where the kernel refuses the call). When the pages are
mapped is :func:`requested_buffer_timing` (``SHARDKIT_CE_GRAD_BUFFER``: "forward", the default, has
``vocab_parallel_cross_entropy``'s forward allocate the gradient buffer and map its pages once it knows
a gradient will be wanted, so that the backward only computes; "backward" allocates it in the backward).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any, Optional

import torch

from shardkit.kernels.embedding import forced_backend
from shardkit.kernels.native_build import native_ops

PAGE_MODES = {"touch": 0, "populate": 1}
PAGES_ENV = "SHARDKIT_CE_PAGES"
BUFFER_TIMINGS = ("forward", "backward")
BUFFER_ENV = "SHARDKIT_CE_GRAD_BUFFER"
_pages_set = False

# the dtypes csrc/cross_entropy.cpp reads (fp64 keeps the torch path: gradcheck wants fp64 work)
NATIVE_CE_DTYPES = (torch.float32, torch.bfloat16)


def _triton_ce() -> Optional[ModuleType]:
    try:
        return importlib.import_module("shardkit.kernels.triton_ce")
    except ImportError:
        return None


def triton_ce_kernels(logits2d: torch.Tensor, unsupported: Optional[str]) -> Optional[ModuleType]:
    """:mod:`shardkit.kernels.triton_ce` when it runs this shard, else None (use the torch blocks).

    ``logits2d``: ``[T, V/tp]`` with contiguous rows. ``unsupported``: what the call needs that the
    kernels lack (e.g. "label smoothing"), or None. Under ``kernel_backend("triton")`` a shard the
    kernels cannot run raises RuntimeError saying why, instead of falling back.
    """
    forced = forced_backend()
    if forced in ("torch", "native"):
        return None
    if forced is None and (unsupported is not None or logits2d.device.type == "cpu"):
        # CPU tensors never import triton here, unless a test forces it (Triton's interpreter)
        return None
    kernels = _triton_ce()
    runnable = kernels is not None and kernels.available(logits2d) and logits2d.stride(1) == 1
    if forced == "triton" and (unsupported is not None or not runnable):
        why = unsupported or f"{tuple(logits2d.shape)} {logits2d.dtype} logits on {logits2d.device}"
        raise RuntimeError(f"the triton cross-entropy kernels cannot run this call: {why}")
    return kernels if runnable and unsupported is None else None


def requested_page_mode(environ=os.environ, platform: str = sys.platform) -> str:
    """The page mode the native gradient should use: ``SHARDKIT_CE_PAGES`` ("touch" / "populate",
    case-insensitive; unset or empty: "populate" on Linux, "touch" elsewhere, where ``madvise`` with
    ``MADV_POPULATE_WRITE`` does not exist). Any other value raises ValueError naming the variable.
    """
    value = environ.get(PAGES_ENV, "").strip().lower()
    if not value:
        return "populate" if platform.startswith("linux") else "touch"
    if value not in PAGE_MODES:
        raise ValueError(f"{PAGES_ENV}={environ[PAGES_ENV]!r}: must be one of {sorted(PAGE_MODES)}")
    return value


def requested_buffer_timing(environ=os.environ) -> str:
    """When the native gradient's buffer is allocated and its pages mapped: ``SHARDKIT_CE_GRAD_BUFFER``
    ("forward" / "backward", case-insensitive; unset or empty: "forward"). Any other value raises
    ValueError naming the variable.

    "forward": the forward of a call whose logits' gradient will be wanted allocates the buffer and maps
    its pages (``ce_map_pages``); the backward writes into it and hands it over. Mapping a fresh
    buffer is kernel work of about 1 us per 4 KiB page on a 2-core Xeon VM (a [4096, 64000] fp32
    gradient: 256,000 pages), as much as the gradient's arithmetic; the forward has no other use for
    the time, but the buffer exists from the forward on (not only from the backward on) until the
    backward or until the graph is freed. "backward": the buffer is allocated in the backward, its pages
    mapped just ahead of the stores.
    """
    value = environ.get(BUFFER_ENV, "").strip().lower()
    if not value:
        return "forward"
    if value not in BUFFER_TIMINGS:
        raise ValueError(f"{BUFFER_ENV}={environ[BUFFER_ENV]!r}: must be one of {list(BUFFER_TIMINGS)}")
    return value


def gradient_page_mode(ops: Any) -> str:
    """The page mode of the native gradient in this process ("touch" or "populate"), set from
    :func:`requested_page_mode` on the first call. The kernel itself drops to "touch" for good when the
    OS refuses ``MADV_POPULATE_WRITE`` (Linux before 5.14), so this can change after a gradient ran.
    """
    global _pages_set
    if not _pages_set:
        ops.ce_fault_mode(PAGE_MODES[requested_page_mode()])
        _pages_set = True
    mode = ops.ce_fault_mode(-1)
    return next(name for name, code in PAGE_MODES.items() if code == mode)


def native_ce_kernels(logits2d: torch.Tensor, unsupported: Optional[str]) -> Optional[Any]:
    """``torch.ops.shardkit_native`` when its CE kernels run this CPU shard, else None (torch blocks).

    ``logits2d``: ``[T, V/tp]``. ``unsupported``: what the call needs that the native kernels lack
    (soft-capping), or None. Under ``kernel_backend("native")`` a call they cannot run raises
    RuntimeError saying why; under ``kernel_backend("torch")`` (or "triton") they are not used.
    """
    forced = forced_backend()
    if forced not in (None, "native") or logits2d.device.type != "cpu":
        return None
    problem = unsupported
    if problem is None and logits2d.dtype not in NATIVE_CE_DTYPES:
        problem = f"{logits2d.dtype} logits (native: {', '.join(map(str, NATIVE_CE_DTYPES))})"
    if problem is None and logits2d.dim() == 2 and logits2d.size(1) > 1 and logits2d.stride(1) != 1:
        problem = "logits whose rows are not contiguous"
    ops = native_ops() if problem is None else None
    if problem is None and ops is None:
        problem = "the native kernels are not built (see shardkit.kernels.native_failure())"
    if problem is not None:
        if forced == "native":
            raise RuntimeError(f"the native cross-entropy kernels cannot run this call: {problem}")
        return None
    if not _pages_set:
        gradient_page_mode(ops)
    return ops


__all__ = [
    "BUFFER_ENV",
    "BUFFER_TIMINGS",
    "NATIVE_CE_DTYPES",
    "PAGES_ENV",
    "PAGE_MODES",
    "gradient_page_mode",
    "native_ce_kernels",
    "requested_buffer_timing",
    "requested_page_mode",
    "triton_ce_kernels",
]
