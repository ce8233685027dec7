"""Next-token log-probs of whole sequences, as RL trainers call them (NeMo RL's front ends).

Position ``i`` of ``[B, S, V/tp]`` vocab-parallel logits is scored against ``target[:, i + 1]``; the
last position of every sequence has no next token. On top of ``shardkit.losses.logprobs`` this adds the
sequence layout: context parallelism (the sequence split over a CP group, load-balanced, see
``shardkit.losses.context_parallel``), packed sequences (``cu_seqlens``: nothing is scored across a
boundary), targets already rolled and CP-sharded by the caller (``target_is_pre_rolled``), and the
sampler's top-k / top-p filter (``sampling_params``), with the CP gradient kept per rank or summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.losses.checks import either_group
from shardkit.losses.context_parallel import (
    context_parallel_positions,
    cp_rank_and_size,
    gather_context_parallel,
    segment_bounds,
)
from shardkit.losses.logprobs import _apply, _prepare
from shardkit.losses.sampling import vocab_parallel_top_k_top_p_mask

# marks the position past the end of each sequence; never a real id
_NO_NEXT_TOKEN = -(2**62)

_CP_GRADIENTS = ("own", "sum")


@dataclass
class TrainingSamplingParams:
    """The sampler's filter, as NeMo RL's ``TrainingSamplingParams``.

    ``top_k``: ``None`` or ``-1`` for no top-k filter; ``top_p``: ``1.0`` for no top-p filter.
    ``temperature`` is carried for the caller: as in NeMo RL, the log-prob functions expect logits
    already divided by it (shardkit's own ``temperature=`` keyword divides them itself).
    """

    top_k: Optional[int] = None
    top_p: float = 1.0
    temperature: float = 1.0


def _sampling_filter(op: str, sampling_params: Any) -> tuple[Optional[int], float]:
    """``(top_k, top_p)`` from a ``TrainingSamplingParams``-like object or dict; ``(None, 1.0)``: none."""
    if sampling_params is None:
        return None, 1.0
    if isinstance(sampling_params, dict):
        top_k, top_p = sampling_params.get("top_k"), sampling_params.get("top_p", 1.0)
    elif hasattr(sampling_params, "top_k") and hasattr(sampling_params, "top_p"):
        top_k, top_p = sampling_params.top_k, sampling_params.top_p
    else:
        raise TypeError(f"{op}: sampling_params must have top_k and top_p, got {sampling_params!r}")
    if top_k is not None and int(top_k) == -1:
        top_k = None
    return (None if top_k is None else int(top_k)), float(1.0 if top_p is None else top_p)


def _filtered_logits(
    op, logits, group, start, end, vocab_size, softcap, temperature, top_k, top_p
) -> torch.Tensor:
    """The logits the sampler drew from: soft-capped, divided by ``temperature``, then ``-inf`` outside
    the top-k / top-p set (a new tensor, differentiable in the kept columns)."""
    z = logits
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if temperature != 1.0:
        z = z / temperature
    keep = vocab_parallel_top_k_top_p_mask(
        z, top_k, top_p, group, vocab_start_index=start, vocab_end_index=end, vocab_size=vocab_size
    )
    return z.masked_fill(~keep, float("-inf"))


def _next_token_targets(target: torch.Tensor, bounds) -> torch.Tensor:
    """``[..., T]`` int64: position ``i`` holds the id at ``i + 1`` of its own sequence, the last
    position of each sequence holds the no-next-token marker (a new tensor; the caller's is kept)."""
    end_marker = torch.full((*target.shape[:-1], 1), _NO_NEXT_TOKEN, dtype=torch.int64, device=target.device)
    shifted = torch.cat([target[..., 1:].to(torch.int64), end_marker], dim=-1)
    if len(bounds) > 1:
        ends = torch.tensor([end - 1 for start, end in bounds if end > start], device=target.device)
        shifted[..., ends] = _NO_NEXT_TOKEN  # no shift across a sequence boundary
    return shifted


def _pre_rolled_targets(op, target, bounds, positions, local_len) -> torch.Tensor:
    """A caller's rolled, CP-sharded ``[..., T/cp]`` target with each sequence's last position (which
    holds the token rolled around from its start) replaced by the no-next-token marker."""
    if target.shape[-1] != local_len:
        raise ValueError(
            f"{op}: target_is_pre_rolled=True needs the target rolled and sharded like the logits, "
            f"[..., {local_len}] positions, got {tuple(target.shape)}"
        )
    last = torch.zeros(bounds[-1][1] if bounds else 0, dtype=torch.bool, device=target.device)
    ends = [end - 1 for start, end in bounds if end > start]
    if ends:
        last[torch.tensor(ends, device=target.device)] = True
    return target.to(torch.int64).masked_fill(last.index_select(0, positions), _NO_NEXT_TOKEN)


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
    *,
    sampling_params=None,
    target_is_pre_rolled: bool = False,
    cp_gradient: str = "own",
    vocab_size=None,
    softcap=None,
    temperature: float = 1.0,
    chunk_size=None,
):
    """Log-probs ``[..., T]`` of the next token at every position of the full (packed) sequence."""
    if not isinstance(target, torch.Tensor) or target.dim() < 1:
        raise ValueError(f"{op}: target must be a [B, S] tensor, got {target!r}")
    if cp_gradient not in _CP_GRADIENTS:
        raise ValueError(f"{op}: cp_gradient must be one of {_CP_GRADIENTS}, got {cp_gradient!r}")
    cp_rank, cp_size = cp_rank_and_size(cp_group, cp_group is not None)
    local_len = vocab_parallel_logits.shape[-2] if vocab_parallel_logits.dim() >= 2 else 0
    total = local_len * cp_size
    bounds = segment_bounds(cu_seqlens, total)
    if target_is_pre_rolled:
        positions = context_parallel_positions(bounds, cp_size, cp_rank, target.device)
        shifted = _pre_rolled_targets(op, target, bounds, positions, local_len)
    else:
        if target.shape[-1] > total:
            raise ValueError(
                f"{op}: target has {target.shape[-1]} positions but the logits hold {local_len} per "
                f"rank x {cp_size} context-parallel ranks = {total}"
            )
        if target.shape[-1] < total:  # padded logits (e.g. to a multiple of 2 * cp): pad the target
            pad = torch.full(
                (*target.shape[:-1], total - target.shape[-1]), _NO_NEXT_TOKEN, device=target.device
            )
            target = torch.cat([target.to(torch.int64), pad], dim=-1)
        shifted = _next_token_targets(target, bounds)
        if cp_size > 1:
            shifted = shifted.index_select(
                -1, context_parallel_positions(bounds, cp_size, cp_rank, target.device)
            )
    top_k, top_p = _sampling_filter(op, sampling_params)
    logits = vocab_parallel_logits
    if top_k is not None or top_p < 1.0:
        logits = _filtered_logits(
            op,
            logits,
            group,
            vocab_start_index,
            vocab_end_index,
            vocab_size,
            softcap,
            temperature,
            top_k,
            top_p,
        )
        softcap, temperature = None, 1.0  # applied above, before the filter, as the sampler did
    local, shifted, opts = _prepare(
        op,
        logits,
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
    logprobs = _apply(local, shifted, opts, inference_only)
    return gather_context_parallel(logprobs, bounds, cp_group, sum_grad=cp_gradient == "sum"), bounds


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    group: Optional[dist.ProcessGroup] = None,
    inference_only: bool = False,
    cp_group: Optional[dist.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    sampling_params: Any = None,
    *,
    cp_gradient: str = "own",
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    tp_group: Optional[dist.ProcessGroup] = None,
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
    over ``cp_group``), equal to the result at cp = 1. ``cp_gradient``: ``"own"`` (default) keeps this
    rank's positions of the gradient (a loss computed identically on every CP rank); ``"sum"`` first
    sums the gradient over the CP ranks, as NeMo RL does (each CP rank's loss on its own part).

    ``sampling_params`` (NeMo RL's): an object or dict with ``top_k`` (``None`` / ``-1``: off) and
    ``top_p``: log-probs under the sampler's filtered, renormalized distribution (``-inf`` for a target
    it could not draw); the filter sees the logits after ``softcap`` and ``temperature``. Costs one
    filtered copy of the logits shard.

    ``tp_group`` (NeMo RL's name of the 5th parameter) is accepted as a keyword for ``group``;
    ``chunk_size`` and ``sampling_params`` may be passed positionally, 8th and 9th, as in NeMo RL.
    """
    group = either_group("from_parallel_logits_to_logprobs", group, tp_group)
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
        sampling_params=sampling_params,
        cp_gradient=cp_gradient,
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
    sampling_params: Any = None,
    target_is_pre_rolled: bool = False,
    *,
    cp_gradient: str = "own",
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

    ``target_is_pre_rolled=True`` (NeMo RL's): ``target`` is ``[1, T/cp]``, already rolled by one within
    each sequence and split like the logits; each sequence's last position (the token rolled around
    from its start) is ignored, as without it. ``sampling_params`` and ``cp_gradient`` as in
    ``from_parallel_logits_to_logprobs``.
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
        sampling_params=sampling_params,
        target_is_pre_rolled=target_is_pre_rolled,
        cp_gradient=cp_gradient,
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


__all__ = [
    "TrainingSamplingParams",
    "from_parallel_logits_to_logprobs",
    "from_parallel_logits_to_logprobs_packed_sequences",
]
