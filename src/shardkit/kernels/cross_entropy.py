"""Which backend runs the vocab-parallel cross-entropy's two passes over one rank's logits shard.

``shardkit.losses`` computes per-token statistics of a ``[T, V/tp]`` shard in forward and the softmax
gradient in backward. On CUDA, when ``triton`` imports, the plain loss (no soft-capping, temperature 1,
no label smoothing, no z-loss) runs each pass as one Triton kernel (:mod:`shardkit.kernels.triton_ce`:
one read of the shard per pass); every other case, and every CPU tensor, runs the pure-torch blocks of
``shardkit.losses.statistics``. :func:`shardkit.kernels.kernel_backend` forces the choice, as for the
embedding ops ("torch" and "native" both mean the pure-torch blocks here: there is no C++ CE kernel).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import torch

from shardkit.kernels.embedding import forced_backend


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


__all__ = ["triton_ce_kernels"]
