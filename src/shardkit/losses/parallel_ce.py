"""The specification's cross-entropy front ends: ``CrossEntropyFunction``, ``parallel_cross_entropy``,
``ParallelCrossEntropy`` (also under the specification's name ``TEParallelCrossEntropy``), and the
specification's ``HAVE_TE_PARALLEL_CE`` / ``MISSING_TE_PARALLEL_CE_MSG``.

They take even vocabulary shards (rank ``r`` of the group holds ``[r * w, (r + 1) * w)``) and share
the kernels, memory budget and communication of ``shardkit.losses.cross_entropy``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from shardkit.losses.checks import REDUCTIONS
from shardkit.losses.cross_entropy import (
    apply_cross_entropy,
    cross_entropy_forward,
    prepare_cross_entropy,
    save_for_backward,
    saved_backward,
)
from shardkit.losses.first_order import first_order_only

# The specification's availability flag and message (NeMo Automodel guards its TE import with them).
# shardkit's parallel cross-entropy is pure PyTorch and always available.
HAVE_TE_PARALLEL_CE = True
MISSING_TE_PARALLEL_CE_MSG = (
    "shardkit's parallel cross-entropy needs no Transformer Engine and is always available; "
    "this message exists for code that checks HAVE_TE_PARALLEL_CE"
)


class CrossEntropyFunction(torch.autograd.Function):
    """Cross-entropy of vocab shards as an autograd Function (the specification's signature).

    Shards are even (``V / tp`` columns each, the specification's case) unless ``vocab_start_index`` /
    ``vocab_end_index`` (this rank's global columns ``[start, end)``, after the specification's
    arguments) say otherwise, as in ``vocab_parallel_cross_entropy``.

    ``_input`` ``[B, S, V/tp]`` or ``[S, B, V/tp]`` (bf16 / fp16 / fp32), ``target`` its leading shape of
    global ids. Returns the fp32 per-token loss ``[B, S]`` (``[S, B]``), or with ``reduce_loss`` the
    mean over tokens whose target is not ``ignore_idx`` (0 when there are none). ``label_smoothing``
    follows ``F.cross_entropy``. The gradient has ``_input``'s dtype; backward communicates nothing.
    Saved for backward: references to ``_input`` and ``target`` (no copy), ``lse`` ``[T]`` fp32, and two
    0-d scalars (the token count, the real vocabulary size).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        _input,
        target,
        label_smoothing=0.0,
        reduce_loss=False,
        dist_process_group=None,
        ignore_idx=-100,
        vocab_start_index=None,
        vocab_end_index=None,
    ):
        logits, target, opts = prepare_cross_entropy(
            "CrossEntropyFunction",
            _input,
            target,
            dist_process_group,
            vocab_start_index,
            vocab_end_index,
            ignore_index=ignore_idx,
            label_smoothing=label_smoothing,
            reduction="mean" if reduce_loss else "none",
        )
        out, lse, count, vocab = cross_entropy_forward(logits, target, opts)
        save_for_backward(ctx, logits, target, lse, count, vocab, opts)
        return out

    @staticmethod
    @first_order_only  # backward is a closed-form kernel, not a graph: double backward raises
    def backward(ctx, grad_output):  # type: ignore[override]
        return saved_backward(ctx, grad_output), None, None, None, None, None, None, None


def parallel_cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    reduce_loss: bool = False,
    dist_process_group: Optional[dist.ProcessGroup] = None,
    ignore_idx: int = -100,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
) -> torch.Tensor:
    """``CrossEntropyFunction`` as a function (keywords allowed); a no-grad call saves nothing."""
    logits, target, opts = prepare_cross_entropy(
        "parallel_cross_entropy",
        input,
        target,
        dist_process_group,
        vocab_start_index,
        vocab_end_index,
        ignore_index=ignore_idx,
        label_smoothing=label_smoothing,
        reduction="mean" if reduce_loss else "none",
    )
    return apply_cross_entropy(logits, target, opts)


class ParallelCrossEntropy:
    """Tensor-parallel cross-entropy called as ``loss_fn(logits, labels, mask=None)``.

    ``logits`` ``[..., V/tp]`` (even shards over ``tp_group`` unless ``vocab_start_index`` /
    ``vocab_end_index`` give this rank's columns; group None: the default group, which is a single
    rank when torch.distributed is not initialized) or a DTensor sharded on the last dim;
    ``labels`` ``[...]`` global ids. Positions where ``mask`` is 0 / False are ignored, like labels equal
    to ``ignore_index``; the caller's labels are never modified (the mask is applied to a new tensor).
    ``reduction``: "none" (fp32 ``[...]``), "sum", or "mean" over non-ignored tokens (0 when none).
    Keyword options (``label_smoothing``, ``z_loss``, ``softcap``, ``temperature``, ``vocab_size``,
    ``dp_group``, ``chunk_size``) are those of ``vocab_parallel_cross_entropy``.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "sum",
        tp_group: Optional[dist.ProcessGroup] = None,
        vocab_start_index: Optional[int] = None,
        vocab_end_index: Optional[int] = None,
        **options,
    ) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"Invalid reduction: {reduction!r} (must be one of {REDUCTIONS})")
        unknown = set(options) - {
            "label_smoothing",
            "z_loss",
            "softcap",
            "temperature",
            "vocab_size",
            "dp_group",
            "chunk_size",
        }
        if unknown:
            raise TypeError(f"ParallelCrossEntropy got unknown options {sorted(unknown)}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.tp_group = tp_group
        self.vocab_range = (vocab_start_index, vocab_end_index)
        self.options = options

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        num_label_tokens: Optional[Union[int, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """``num_label_tokens`` (NeMo Automodel's): with ``reduction="sum"``, the sum is divided by it
        (e.g. the number of label tokens over all micro-batches of a gradient-accumulation step).
        With another reduction it raises ``ValueError`` rather than being ignored.
        """
        if num_label_tokens is not None and self.reduction != "sum":
            raise ValueError(
                f"ParallelCrossEntropy: num_label_tokens normalizes a summed loss; "
                f"reduction is {self.reduction!r}, not 'sum'"
            )
        problems = []
        if mask is not None:
            if tuple(mask.shape) != tuple(labels.shape):
                problems.append(f"mask shape {tuple(mask.shape)} does not match labels {tuple(labels.shape)}")
            else:
                # a new tensor: the caller's labels stay as they are
                labels = torch.where(mask.bool(), labels, torch.full_like(labels, self.ignore_index))
        local, target, opts = prepare_cross_entropy(
            "ParallelCrossEntropy",
            logits,
            labels,
            self.tp_group,
            *self.vocab_range,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            problems=problems,
            **self.options,
        )
        loss = apply_cross_entropy(local, target, opts)
        if num_label_tokens is not None:
            loss = loss / num_label_tokens
        return loss

    def __repr__(self) -> str:
        return f"ParallelCrossEntropy(ignore_index={self.ignore_index}, reduction={self.reduction!r})"


# the specification's name, for code written against it
TEParallelCrossEntropy = ParallelCrossEntropy
