"""The specification's cross-entropy front ends: ``CrossEntropyFunction``, ``parallel_cross_entropy``,
``ParallelCrossEntropy`` (also under the specification's name ``TEParallelCrossEntropy``).

They take even vocabulary shards (rank ``r`` of the group holds ``[r * w, (r + 1) * w)``) and share
the kernels, memory budget and communication of ``shardkit.losses.cross_entropy``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from shardkit.losses.checks import REDUCTIONS
from shardkit.losses.cross_entropy import (
    apply_cross_entropy,
    cross_entropy_forward,
    prepare_cross_entropy,
    save_for_backward,
    saved_backward,
)


class CrossEntropyFunction(torch.autograd.Function):
    """Cross-entropy of even vocab shards as an autograd Function (the specification's signature).

    ``_input`` ``[B, S, V/tp]`` or ``[S, B, V/tp]`` (bf16 / fp16 / fp32), ``target`` its leading shape of
    global ids. Returns the fp32 per-token loss ``[B, S]`` (``[S, B]``), or with ``reduce_loss`` the
    mean over tokens whose target is not ``ignore_idx`` (0 when there are none). ``label_smoothing``
    follows ``F.cross_entropy``. The gradient has ``_input``'s dtype; backward communicates nothing.
    Saved for backward: references to ``_input`` and ``target``, ``lse`` ``[T]`` fp32, the token count.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, _input, target, label_smoothing=0.0, reduce_loss=False, dist_process_group=None, ignore_idx=-100
    ):
        logits, target, opts = prepare_cross_entropy(
            "CrossEntropyFunction",
            _input,
            target,
            dist_process_group,
            None,
            None,
            ignore_index=ignore_idx,
            label_smoothing=label_smoothing,
            reduction="mean" if reduce_loss else "none",
        )
        out, lse, count, vocab = cross_entropy_forward(logits, target, opts)
        save_for_backward(ctx, logits, target, lse, count, vocab, opts)
        return out

    @staticmethod
    @once_differentiable  # backward is a closed-form kernel, not a graph: no double backward
    def backward(ctx, grad_output):  # type: ignore[override]
        return saved_backward(ctx, grad_output), None, None, None, None, None


def parallel_cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    reduce_loss: bool = False,
    dist_process_group: Optional[dist.ProcessGroup] = None,
    ignore_idx: int = -100,
) -> torch.Tensor:
    """``CrossEntropyFunction`` as a function (keywords allowed); a no-grad call saves nothing."""
    logits, target, opts = prepare_cross_entropy(
        "parallel_cross_entropy",
        input,
        target,
        dist_process_group,
        None,
        None,
        ignore_index=ignore_idx,
        label_smoothing=label_smoothing,
        reduction="mean" if reduce_loss else "none",
    )
    return apply_cross_entropy(logits, target, opts)


class ParallelCrossEntropy:
    """Tensor-parallel cross-entropy called as ``loss_fn(logits, labels, mask=None)``.

    ``logits`` ``[..., V/tp]`` (even shards over ``tp_group``; None: the default group, which is a
    single rank when torch.distributed is not initialized) or a DTensor sharded on the last dim;
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
        **options,
    ) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
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
        self.options = options

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
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
            None,
            None,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            problems=problems,
            **self.options,
        )
        return apply_cross_entropy(local, target, opts)

    def __repr__(self) -> str:
        return f"ParallelCrossEntropy(ignore_index={self.ignore_index}, reduction={self.reduction!r})"


# the specification's name, for code written against it
TEParallelCrossEntropy = ParallelCrossEntropy
