"""The cross-entropy gradient's per-token coefficients and its blocks, recomputed from ``lse`` (L2).

``d loss / d z = coef_p * softmax(z) - coef_target * onehot(target) - coef_uniform`` per token (see
:func:`shardkit.losses.statistics.softmax_gradient_blocks`); the coefficients fold in the incoming
gradient, the reduction, z-loss and label smoothing. Used by the vocab-parallel cross-entropy's backward
and the fused linear cross-entropy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

import torch

from shardkit.losses import statistics as st

if TYPE_CHECKING:  # the options' module imports this one
    from shardkit.losses.cross_entropy import CrossEntropyOptions


def per_token_grad(
    grad_output: torch.Tensor, reduction: str, count: torch.Tensor, num_rows: int, dtype: torch.dtype
) -> torch.Tensor:
    """The incoming gradient as one coefficient per token, ``[T]`` in the work dtype."""
    g = grad_output.to(dtype)
    if reduction == "none":
        return g.reshape(-1)
    if reduction == "mean":
        g = g / count.clamp(min=1.0).to(dtype)
    return g.reshape(1).expand(num_rows)


def gradient_blocks(
    source: st.Source,
    grad_output: torch.Tensor,
    target1d: torch.Tensor,
    lse: torch.Tensor,
    count: torch.Tensor,
    vocab: torch.Tensor,
    opts: CrossEntropyOptions,
    out: Optional[torch.Tensor] = None,
    rows: Optional[int] = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(i0, i1, d loss / d logits[i0:i1])`` blocks in the work dtype, recomputed from ``lse``, locally.

    ``out`` / ``rows``: see ``statistics.softmax_gradient_blocks`` (``rows`` defaults to ``opts.rows``).
    """
    num_rows = target1d.numel()
    index, owned, active, coef_p, coef_target, coef_uniform = gradient_coefficients(
        grad_output, target1d, lse, count, vocab, opts
    )
    return st.softmax_gradient_blocks(
        source,
        num_rows,
        opts.shard,
        opts.transform,
        lse,
        index,
        owned,
        active,
        coef_p,
        coef_target,
        coef_uniform,
        opts.rows if rows is None else rows,
        out=out,
    )


def gradient_coefficients(
    grad_output: torch.Tensor,
    target1d: torch.Tensor,
    lse: torch.Tensor,
    count: torch.Tensor,
    vocab: torch.Tensor,
    opts: CrossEntropyOptions,
) -> tuple[torch.Tensor, ...]:
    """``(index, owned, active, coef_p, coef_target, coef_uniform)``, all ``[T]`` (see
    ``statistics.softmax_gradient_blocks`` for what the coefficients multiply)."""
    num_rows = target1d.numel()
    index, owned, active = st.local_target_index(target1d, opts.shard, opts.ignore_index)
    g = per_token_grad(grad_output, opts.reduction, count, num_rows, lse.dtype)
    return (index, owned, active, *loss_coefficients(g, lse, vocab, opts))


def loss_coefficients(
    g: torch.Tensor, lse: torch.Tensor, vocab: torch.Tensor, opts: CrossEntropyOptions
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(coef_p, coef_target, coef_uniform)`` ``[T]`` for per-token incoming gradients ``g`` ``[T]``."""
    coef_p = g * (1.0 + 2.0 * opts.z_loss * lse) if opts.z_loss else g
    coef_uniform = g * (opts.label_smoothing / vocab) if opts.label_smoothing else None
    return coef_p, g * (1.0 - opts.label_smoothing), coef_uniform


__all__ = [
    "per_token_grad",
    "gradient_blocks",
    "gradient_coefficients",
    "loss_coefficients",
]
