"""Which kernel computes a cross-entropy call's statistics and gradient, and the calls into it (L2).

The Triton kernels (CUDA, the plain loss) and the native CPU kernels (fp32 / bf16, no soft-capping)
compute the same per-token statistics and gradient as the blocked torch path of
:mod:`shardkit.losses.statistics`; these functions pick them for a call and adapt the options
(:class:`~shardkit.losses.cross_entropy.CrossEntropyOptions`) to their arguments. Used by the
vocab-parallel cross-entropy and the fused linear cross-entropy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardkit.kernels.cpu_cache import cache_sizes, columns_in_cache
from shardkit.kernels.cross_entropy import native_ce_kernels, triton_ce_kernels

if TYPE_CHECKING:  # the options' module imports this one
    from shardkit.losses.cross_entropy import CrossEntropyOptions

# a target id no call can have: the Triton kernels' "ignore" value when nothing is ignored
_NO_IGNORED_ID = -(2**62)


def triton_kernels(logits2d: torch.Tensor, opts: CrossEntropyOptions):
    """The Triton CE kernels when they run this call (CUDA, the plain loss), else None.

    ``logits2d``: the ``[T, V/tp]`` logits, or any tensor of their dtype and device with contiguous
    rows (the fused linear loss passes an empty one).
    """
    unsupported = [
        name
        for name, used in (
            ("soft-capping", opts.transform.softcap is not None),
            ("temperature", opts.transform.temperature != 1.0),
            ("label smoothing", opts.label_smoothing > 0.0),
            ("z-loss", opts.z_loss != 0.0),
        )
        if used
    ]
    return triton_ce_kernels(logits2d, ", ".join(unsupported) or None)


def _ignored_id(opts: CrossEntropyOptions) -> int:
    return _NO_IGNORED_ID if opts.ignore_index is None else opts.ignore_index


def triton_statistics(kernels, logits2d, target1d, opts: CrossEntropyOptions) -> torch.Tensor:
    """This shard's ``[T, 3]`` fp32 statistics (max, sum of exp, target logit) by one Triton pass over
    the real columns of ``logits2d`` ``[T, V/tp]``."""
    real = logits2d[:, : opts.shard.real_width]
    return torch.stack(kernels.ce_statistics(real, target1d, opts.shard.start, _ignored_id(opts)), dim=1)


def triton_gradient(kernels, logits2d, target1d, lse, g, opts: CrossEntropyOptions, out, c0: int = 0):
    """``out = (exp(x - lse) - onehot(target)) * g`` per token by one Triton pass, for the columns
    ``[c0, c0 + w)`` of the shard held by ``logits2d`` ``[T, w]`` (``out`` may be ``logits2d``);
    padding columns get 0, as do ignored tokens. ``lse``, ``g``: ``[T]`` (``p = exp(x - M) / S`` with
    ``M = lse`` and ``S = 1``)."""
    real = max(0, min(opts.shard.real_width - c0, logits2d.size(1)))
    kernels.ce_gradient(
        logits2d[:, :real], target1d, opts.shard.start + c0, lse, torch.ones_like(lse), g,
        _ignored_id(opts), out=out[:, :real],
    )  # fmt: skip
    out[:, real:] = 0
    return out


def native_kernels(logits2d: torch.Tensor, opts: CrossEntropyOptions):
    """The native CPU CE kernels when they run this call (fp32 / bf16, no soft-capping), else None."""
    return native_ce_kernels(logits2d, "soft-capping" if opts.transform.softcap is not None else None)


def native_statistics(ops, logits2d, index, owned, opts: CrossEntropyOptions) -> torch.Tensor:
    """This shard's ``[T, 3]`` (``[T, 4]`` with label smoothing) fp32 statistics of ``logits2d``
    ``[T, w]`` by the native kernel: each row is read once, in chunks sized to this CPU's L1d
    (``shardkit.kernels.cpu_cache``) so that the chunk's exp-sum re-reads it from L1."""
    chunk = columns_in_cache(logits2d.element_size(), cache_sizes().l1d)
    return ops.ce_statistics(
        logits2d, index, owned, opts.shard.real_width, 1.0 / opts.transform.temperature,
        opts.label_smoothing > 0.0, chunk,
    )  # fmt: skip


def native_gradient(
    ops, logits2d, out, lse, coefficients, opts: CrossEntropyOptions, premapped: bool = False
) -> torch.Tensor:
    """``out`` ``[T, w]`` (the logits' dtype or fp32; may be ``logits2d``) = the gradient of
    ``softmax_gradient_blocks`` with the ``coefficients`` of :func:`gradient_coefficients`, written by
    the native kernel in one pass (one read of the logits, one write of ``out``). ``premapped``: ``out``
    came from :func:`forward_gradient_buffer` (its pages are mapped already)."""
    index, owned, active, coef_p, coef_target, coef_uniform = coefficients
    scale = 1.0 / opts.transform.temperature
    # d z / d x = 1 / temperature folded into the coefficients; contiguous fp32 [T] each
    minus_target = torch.where(owned, -coef_target, torch.zeros_like(coef_target)) * scale
    coef_p = (coef_p * scale).float().contiguous()
    coef_uniform = None if coef_uniform is None else (coef_uniform * scale).float().contiguous()
    return ops.ce_gradient(
        logits2d, out, lse.float().contiguous(), coef_p, minus_target.float().contiguous(), coef_uniform,
        index.contiguous(), active.contiguous(), opts.shard.real_width, scale, premapped,
    )  # fmt: skip


__all__ = [
    "triton_kernels",
    "triton_statistics",
    "triton_gradient",
    "native_kernels",
    "native_statistics",
    "native_gradient",
]
