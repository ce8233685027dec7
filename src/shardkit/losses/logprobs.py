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

from shardkit.losses.context_parallel import (
    context_parallel_positions,
    cp_rank_and_size,
    gather_context_parallel,
    segment_bounds,
)
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


class ChunkedDistributedLogprob(torch.autograd.Function):
    """``DistributedLogprob`` worked in blocks of ``chunk_size`` sequence positions (NeMo RL's name).

    ``apply(vocab_parallel_logits [B, S, V/tp], target [B, S] (already shifted), vocab_start_index,
    vocab_end_index, chunk_size, tp_group, inference_only=False)`` -> fp32 ``[B, S]``. Every fp32 work
    block is ``chunk_size * B`` rows (``[chunk_size * B, V/tp]``), in forward and in the backward's
    recomputation, so the extra memory is bounded by the chunk, not by ``S``. Saved for backward: the
    logits and target (references), ``lse`` ``[B * S]`` fp32 and two 0-d scalars. Backward: no
    communication. (``DistributedLogprob`` is chunked too, by about 8M elements per block.)
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int,
        tp_group: dist.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        rows = None
        if isinstance(chunk_size, int) and chunk_size >= 1 and vocab_parallel_logits.dim() >= 2:
            batch = vocab_parallel_logits.numel() // max(1, vocab_parallel_logits.shape[-2:].numel())
            rows = chunk_size * max(1, batch)
        problems = [] if rows is not None else [f"chunk_size must be a positive int, got {chunk_size!r}"]
        logits, target, opts = prepare_cross_entropy(
            "ChunkedDistributedLogprob",
            vocab_parallel_logits,
            target,
            tp_group,
            vocab_start_index,
            vocab_end_index,
            ignore_index=None,
            reduction="none",
            chunk_size=rows,
            problems=problems,
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
            raise RuntimeError(
                "ChunkedDistributedLogprob was called with inference_only=True: it has no backward"
            )
        return saved_backward(ctx, -grad_outputs[0]), None, None, None, None, None, None


def _next_token_targets(target: torch.Tensor, bounds) -> torch.Tensor:
    """``[..., T]`` int64: position ``i`` holds the id at ``i + 1`` of its own sequence, the last
    position of each sequence holds the no-next-token marker (a new tensor; the caller's is kept)."""
    end_marker = torch.full((*target.shape[:-1], 1), _NO_NEXT_TOKEN, dtype=torch.int64, device=target.device)
    shifted = torch.cat([target[..., 1:].to(torch.int64), end_marker], dim=-1)
    if len(bounds) > 1:
        ends = torch.tensor([end - 1 for start, end in bounds if end > start], device=target.device)
        shifted[..., ends] = _NO_NEXT_TOKEN  # no shift across a sequence boundary
    return shifted


def _next_token_logprobs(
    op,
    vocab_parallel_logits,
    target,
    vocab_start_index,
    vocab_end_index,
    group,
    inference_only,
    cp_group,
    cu_seqlens,
    **options,
):
    """Log-probs ``[..., T]`` of the next token at every position of the full (packed) sequence."""
    if not isinstance(target, torch.Tensor) or target.dim() < 1:
        raise ValueError(f"{op}: target must be a [B, S] tensor, got {target!r}")
    cp_rank, cp_size = cp_rank_and_size(cp_group, cp_group is not None)
    local_len = vocab_parallel_logits.shape[-2] if vocab_parallel_logits.dim() >= 2 else 0
    total = local_len * cp_size
    if target.shape[-1] > total:
        raise ValueError(
            f"{op}: target has {target.shape[-1]} positions but the logits hold {local_len} per rank "
            f"x {cp_size} context-parallel ranks = {total}"
        )
    if target.shape[-1] < total:  # padded logits (e.g. to a multiple of 2 * cp): pad the target too
        pad = torch.full((*target.shape[:-1], total - target.shape[-1]), _NO_NEXT_TOKEN, device=target.device)
        target = torch.cat([target.to(torch.int64), pad], dim=-1)
    bounds = segment_bounds(cu_seqlens, total)
    shifted = _next_token_targets(target, bounds)
    if cp_size > 1:
        shifted = shifted.index_select(
            -1, context_parallel_positions(bounds, cp_size, cp_rank, target.device)
        )
    local, shifted, opts = _prepare(
        op,
        vocab_parallel_logits,
        shifted,
        group,
        vocab_start_index,
        vocab_end_index,
        ignore_index=_NO_NEXT_TOKEN,
        **options,
    )
    return gather_context_parallel(_apply(local, shifted, opts, inference_only), bounds, cp_group), bounds


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    group: dist.ProcessGroup,
    inference_only: bool = False,
    cp_group: Optional[dist.ProcessGroup] = None,
    *,
    chunk_size: Optional[int] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Next-token log-probs: position ``i`` of ``[B, S, V/tp]`` logits scored against ``target[:, i + 1]``.

    ``target`` ``[B, S]`` global ids (unshifted). Returns fp32 ``[B, S - 1]`` (the last position has
    no next token and is dropped; it receives no gradient). The logits are not sliced or copied: the
    last position is computed as an ignored token and cut from the result. ``chunk_size``: tokens per
    fp32 work block. Memory and communication as ``DistributedLogprob``.

    ``cp_group`` (NeMo RL's 7th parameter): the sequence is split over a context-parallel group,
    load-balanced (see ``shardkit.losses.context_parallel``): the logits are ``[B, S/cp, V/tp]``, this
    rank's two pieces; ``target`` is the full ``[B, S]``, padded or not to the ``S`` the logits cover.
    The result is the full ``[B, S - 1]`` on every CP rank (one extra all-gather of ``[B, S/cp]`` fp32
    over ``cp_group``), equal to the result at cp = 1; its backward keeps this rank's positions.
    """
    logprobs, _ = _next_token_logprobs(
        "from_parallel_logits_to_logprobs",
        vocab_parallel_logits,
        target,
        vocab_start_index,
        vocab_end_index,
        group,
        inference_only,
        cp_group,
        None,
        vocab_size=vocab_size,
        softcap=softcap,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return logprobs[..., : target.shape[-1] - 1]


def from_parallel_logits_to_logprobs_packed_sequences(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    unpacked_seqlen: int,
    vocab_start_index: int,
    vocab_end_index: int,
    group: dist.ProcessGroup,
    inference_only: bool = False,
    cp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    *,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Next-token log-probs of packed sequences, unpacked: fp32 ``[N, unpacked_seqlen - 1]``.

    ``vocab_parallel_logits`` ``[1, T/cp, V/tp]`` (``T`` packed tokens; with ``cp_group``, this rank's
    two pieces of every sequence, Transformer Engine's THD layout), ``target`` ``[1, T]`` unshifted,
    ``cu_seqlens_padded`` ``[N + 1]`` the (padded) sequence boundaries. Row ``i`` holds sequence ``i``'s
    log-probs at positions ``0 .. len_i - 2`` (each scored against the next token of the same sequence;
    nothing crosses a boundary) and zeros after. Reads ``cu_seqlens_padded`` on the host once.
    """
    op = "from_parallel_logits_to_logprobs_packed_sequences"
    logprobs, bounds = _next_token_logprobs(
        op,
        vocab_parallel_logits,
        target,
        vocab_start_index,
        vocab_end_index,
        group,
        inference_only,
        cp_group,
        cu_seqlens_padded,
        vocab_size=vocab_size,
        softcap=softcap,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    flat = logprobs.reshape(-1)
    rows, cols, src = [], [], []
    for i, (start, end) in enumerate(bounds):
        n = max(0, min(end - start - 1, unpacked_seqlen - 1))
        rows.append(torch.full((n,), i, dtype=torch.int64))
        cols.append(torch.arange(n))
        src.append(torch.arange(start, start + n))
    out = flat.new_zeros(len(bounds), max(0, unpacked_seqlen - 1))
    if rows:
        device = flat.device
        index = (torch.cat(rows).to(device), torch.cat(cols).to(device))
        out = out.index_put(index, flat.index_select(0, torch.cat(src).to(device)))
    return out
