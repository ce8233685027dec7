"""Per-token log-probabilities of target ids from vocab-sharded logits (the RL log-prob path).

``logprob[t] = z[t, target[t]] - logsumexp(z[t, :])`` over the whole vocabulary, with ``z`` the
(optionally soft-capped and temperature-scaled) logits. It is the negated cross-entropy without
smoothing or z-loss, so it shares that loss's kernels, memory budget and communication (forward: one
all-gather of ``[T, 3]`` fp32 statistics; backward: none, the gradient on each shard is
``grad * (onehot(target) - softmax)`` restricted to that shard). Saved for backward: references to
the logits and target and ``lse`` ``[T]`` fp32; ``inference_only=True`` or a no-grad call saves nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.losses.cross_entropy import (
    CrossEntropyOptions,
    cross_entropy_forward,
    prepare_cross_entropy,
    save_for_backward,
    saved_backward,
)
from shardkit.losses.first_order import first_order_only

# marks the position past the end of each sequence in the next-token path; never a real id
_NO_NEXT_TOKEN = -(2**62)


def _prepare(op, logits, target, group, start, end, ignore_index=None, **options):
    return prepare_cross_entropy(
        op, logits, target, group, start, end, ignore_index=ignore_index, reduction="none", **options
    )


def _logprob_forward(logits, target, opts: CrossEntropyOptions):
    loss, lse, count, vocab = cross_entropy_forward(logits, target, opts)
    return -loss, lse, count, vocab


class _LogprobFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, opts):  # type: ignore[override]
        out, lse, count, vocab = _logprob_forward(logits, target, opts)
        save_for_backward(ctx, logits, target, lse, count, vocab, opts)
        return out

    @staticmethod
    @first_order_only  # backward is a closed-form kernel, not a graph: double backward raises
    def backward(ctx, grad_output):  # type: ignore[override]
        return saved_backward(ctx, -grad_output), None, None


def _apply(logits, target, opts, inference_only: bool) -> torch.Tensor:
    if inference_only or not (torch.is_grad_enabled() and logits.requires_grad):
        with torch.no_grad():  # nothing recorded, nothing saved
            return _logprob_forward(logits, target, opts)[0]
    return _LogprobFunction.apply(logits, target, opts)


class DistributedLogprob(torch.autograd.Function):
    """Log-probabilities of ``target`` under vocab-parallel logits (the specification's signature).

    ``vocab_parallel_logits`` ``[..., V/tp]`` holds the columns ``[vocab_start_index,
    vocab_end_index)``; ``target`` ``[...]`` global ids in ``[0, V)``. Returns fp32 ``[...]``. Backward
    needs no communication. With ``inference_only`` nothing is saved and backward must not be called.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        group: dist.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        logits, target, opts = _prepare(
            "DistributedLogprob", vocab_parallel_logits, target, group, vocab_start_index, vocab_end_index
        )
        out, lse, count, vocab = _logprob_forward(logits, target, opts)
        ctx.inference_only = inference_only
        if not inference_only:
            save_for_backward(ctx, logits, target, lse, count, vocab, opts)
        return out

    @staticmethod
    @first_order_only  # backward is a closed-form kernel, not a graph: double backward raises
    def backward(ctx, *grad_outputs: torch.Tensor):  # type: ignore[override]
        if ctx.inference_only:
            raise RuntimeError("DistributedLogprob was called with inference_only=True: it has no backward")
        return saved_backward(ctx, -grad_outputs[0]), None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    vocab_size: Optional[int] = None,
    ignore_index: Optional[int] = None,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    inference_only: bool = False,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """``log softmax(z)[target]`` per token, fp32 ``[...]``, for logits ``[..., V/tp]`` (or a DTensor).

    Options as for ``vocab_parallel_cross_entropy``; tokens equal to ``ignore_index`` (when given) get
    0 and no gradient. ``inference_only`` (or no grad) saves nothing for backward.
    """
    local, target, opts = _prepare(
        "vocab_parallel_logprobs",
        logits,
        target,
        group,
        vocab_start_index,
        vocab_end_index,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
        softcap=softcap,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return _apply(local, target, opts, inference_only)


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    group: dist.ProcessGroup,
    inference_only: bool = False,
    *,
    chunk_size: Optional[int] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Next-token log-probs: position ``i`` of ``[B, S, V/tp]`` logits scored against ``target[:, i + 1]``.

    ``target`` ``[B, S]`` global ids. Returns fp32 ``[B, S - 1]`` (the last position has no next
    token and is dropped; it receives no gradient). The logits are not sliced or copied: the last
    position is computed as an ignored token and cut from the result. ``chunk_size``: tokens per fp32
    work block. Memory and communication as ``DistributedLogprob``.
    """
    if not isinstance(target, torch.Tensor) or target.dim() < 1:
        raise ValueError(f"from_parallel_logits_to_logprobs: target must be a [B, S] tensor, got {target!r}")
    # a new [B, S] int64 tensor: the caller's target is not touched
    end_marker = torch.full((*target.shape[:-1], 1), _NO_NEXT_TOKEN, dtype=torch.int64, device=target.device)
    shifted = torch.cat([target[..., 1:].to(torch.int64), end_marker], dim=-1)
    local, shifted, opts = _prepare(
        "from_parallel_logits_to_logprobs",
        vocab_parallel_logits,
        shifted,
        group,
        vocab_start_index,
        vocab_end_index,
        ignore_index=_NO_NEXT_TOKEN,
        vocab_size=vocab_size,
        softcap=softcap,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return _apply(local, shifted, opts, inference_only)[..., :-1]
