"""What RL trainers compute around sampling, over a vocabulary split across tensor-parallel ranks.

- ``apply_top_k_top_p`` (NeMo RL's name, unsharded) and ``vocab_parallel_top_k_top_p_mask`` (sharded):
  the tokens a top-k / top-p (nucleus) sampler can draw. Top-k keeps the logits ``>=`` the k-th largest
  (ties included, as vLLM); top-p then keeps, in descending order of probability renormalized over what
  top-k kept, the tokens whose predecessors' mass is below ``p`` (the token that crosses ``p`` is kept).
  Equal logits are kept or dropped together; vLLM's sort may split a tie at the top-p boundary.
  The sharded mask equals the unsharded one: it gathers each rank's top ``K`` candidates ([T, K, 2]
  fp64 per all-gather; ``K = top_k``, or 64 doubling until the nucleus is inside the candidates) and
  all-reduces one ``[T]`` fp64 normalizer.
- ``vocab_parallel_sampling_logprobs``: log-probs of the targets under the filtered, renormalized
  distribution (``-inf`` for a target the sampler could not draw); differentiable like
  ``vocab_parallel_logprobs``. Costs one masked copy of the logits shard (1 unit of memory).
- ``distributed_vocab_topk`` (NeMo RL's): global top-k values (fp32) and ids, no gradient.
- ``gather_logits_at_global_indices`` (NeMo RL's): the logits at given global ids, ``[B, S, k]`` fp32,
  differentiable, with optional context parallelism.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_size
from shardkit.distributed.regions import reduce_from_region
from shardkit.losses import statistics as st
from shardkit.losses.context_parallel import (
    context_parallel_positions,
    gather_context_parallel,
    segment_bounds,
)
from shardkit.losses.logprobs import vocab_parallel_logprobs
from shardkit.losses.rl_helpers import _all_gather_rows, _local_top, _merge_top, _prepare, vocab_parallel_topk

_FIRST_CANDIDATES = 64


def _check_sampling(top_k: Optional[int], top_p: float) -> list[str]:
    problems = []
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        problems.append(f"top_k must be None or a positive int, got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not 0.0 < float(top_p) <= 1.0:
        problems.append(f"top_p must be in (0, 1], got {top_p!r}")
    return problems


def _keep_threshold(
    logits2d: torch.Tensor,
    shard: st.VocabShard,
    top_k: Optional[int],
    top_p: float,
    group,
    op: str,
    local: bool = False,
) -> torch.Tensor:
    """Per row, the smallest logit a top-k / top-p sampler keeps: ``[T]`` fp64.

    Collective over ``group`` unless ``local`` (the whole vocabulary is in ``logits2d``).
    """
    num_rows = logits2d.size(0)
    communicate = not local and group_size(group) > 1
    real = logits2d[:, : shard.real_width]
    k = top_k or _FIRST_CANDIDATES
    while True:
        candidates = _local_top(logits2d, shard, k)
        gathered = _all_gather_rows(candidates, group) if communicate else candidates.unsqueeze(0)
        values, ids = _merge_top(gathered, k)
        missing = torch.isinf(ids)  # fewer real columns than k in the whole vocabulary
        if top_k is not None and bool(missing.any()):
            raise ValueError(f"{op}: top_k={top_k} is larger than the real vocabulary size")
        no_floor = torch.full((num_rows,), float("-inf"), dtype=torch.float64, device=logits2d.device)
        floor = values[:, -1] if top_k is not None else no_floor
        if top_p >= 1.0:
            return floor
        top = values[:, :1]
        # normalizer over what top-k keeps (ties included), summed over the ranks
        norm = torch.zeros(num_rows, dtype=torch.float64, device=logits2d.device)
        for i0, i1 in st.row_blocks(num_rows, st.chunk_rows(max(1, shard.real_width), None)):
            z = real[i0:i1].to(torch.float64)
            weight = torch.exp(z - top[i0:i1])
            norm[i0:i1] = torch.where(z >= floor[i0:i1, None], weight, torch.zeros_like(weight)).sum(1)
        if communicate:
            dist.all_reduce(norm, group=group)
        q = torch.where(missing, torch.zeros_like(values), torch.exp(values - top)) / norm[:, None]
        # mass strictly above each candidate's value (all such tokens are among the candidates)
        above = (q[:, None, :] * (values[:, None, :] > values[:, :, None])).sum(-1)
        kept = (above < top_p) & ~missing
        last_kept = kept[:, -1]
        # the same gathered data on every rank, so every rank takes the same branch
        if top_k is not None or not bool(last_kept.any()) or bool(missing.any()):
            candidate = torch.where(kept, values, torch.full_like(values, float("inf")))
            return torch.maximum(candidate.amin(1), floor)
        k *= 2


def _mask_from_threshold(
    logits2d: torch.Tensor, shard: st.VocabShard, threshold: torch.Tensor
) -> torch.Tensor:
    keep = torch.zeros(logits2d.shape, dtype=torch.bool, device=logits2d.device)
    real = shard.real_width
    for i0, i1 in st.row_blocks(logits2d.size(0), st.chunk_rows(max(1, logits2d.size(1)), None)):
        keep[i0:i1, :real] = logits2d[i0:i1, :real].to(torch.float64) >= threshold[i0:i1, None]
    return keep


def vocab_parallel_top_k_top_p_mask(
    logits: torch.Tensor,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Which columns of this shard a top-k / top-p sampler can draw: bool ``[..., V/tp]``.

    ``logits`` ``[..., V/tp]`` (temperature already applied, as the sampler saw them). Equal to
    ``apply_top_k_top_p`` on the gathered logits (see the module doc for the tie rule). Padding
    columns are never kept. Not differentiable (a mask).
    """
    op = "vocab_parallel_top_k_top_p_mask"
    logits, group, shard = _prepare(
        op, logits, group, vocab_start_index, vocab_end_index, vocab_size, _check_sampling(top_k, top_p)
    )
    logits2d = logits.detach().reshape(-1, logits.size(-1))
    threshold = _keep_threshold(logits2d, shard, top_k, float(top_p), group, op)
    return _mask_from_threshold(logits2d, shard, threshold).view(logits.shape)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[int] = None, top_p: float = 1.0
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """NeMo RL's ``apply_top_k_top_p`` on full-vocabulary logits ``[..., V]``.

    Returns ``(filtered, keep_mask)``: a new tensor with ``-inf`` where the sampler cannot draw, and
    the bool mask ``[..., V]``; ``(logits, None)`` when neither filter is active. No communication.
    """
    if top_k is None and top_p >= 1.0:
        return logits, None
    problems = _check_sampling(top_k, top_p)
    if problems:
        raise ValueError(f"apply_top_k_top_p: {'; '.join(problems)}")
    width = logits.size(-1)
    logits2d = logits.detach().reshape(-1, width)
    shard = st.VocabShard.make(0, width, None)
    # a group of one rank: the sharded code path with no communication
    threshold = _keep_threshold(logits2d, shard, top_k, float(top_p), None, "apply_top_k_top_p", local=True)
    keep = _mask_from_threshold(logits2d, shard, threshold).view(logits.shape)
    return logits.masked_fill(~keep, float("-inf")), keep


def vocab_parallel_sampling_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    vocab_size: Optional[int] = None,
    inference_only: bool = False,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Log-probs ``[...]`` fp32 of ``target`` under the top-k / top-p filtered distribution.

    ``logits`` ``[..., V/tp]`` (temperature applied). A target outside the kept set gets ``-inf``. The
    gradient flows to the kept columns only (the mask is a constant of the sampler). Memory: one
    masked copy of the shard plus ``vocab_parallel_logprobs``'s.
    """
    if top_k is None and top_p >= 1.0:
        return vocab_parallel_logprobs(
            logits,
            target,
            group,
            vocab_start_index=vocab_start_index,
            vocab_end_index=vocab_end_index,
            vocab_size=vocab_size,
            inference_only=inference_only,
            chunk_size=chunk_size,
        )
    keep = vocab_parallel_top_k_top_p_mask(
        logits,
        top_k,
        top_p,
        group,
        vocab_start_index=vocab_start_index,
        vocab_end_index=vocab_end_index,
        vocab_size=vocab_size,
    )
    masked = logits.masked_fill(~keep, float("-inf"))
    return vocab_parallel_logprobs(
        masked,
        target,
        group,
        vocab_start_index=vocab_start_index,
        vocab_end_index=vocab_end_index,
        vocab_size=vocab_size,
        inference_only=inference_only,
        chunk_size=chunk_size,
    )


@torch.no_grad()
def distributed_vocab_topk(
    vocab_parallel_logits: torch.Tensor,
    k: int,
    tp_group: Optional[dist.ProcessGroup],
    *,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeMo RL's global top-k: ``(values [B, S, k] fp32, global ids [B, S, k] int64)``, no gradient.

    ``k`` larger than the vocabulary is clamped to it, as NeMo RL does. Ties go to the lower id.
    ``chunk_size`` is accepted and not needed: the per-rank candidates are selected block by block
    already (``vocab_parallel_topk``).
    """
    del chunk_size
    width_total = torch.tensor([vocab_end_index - vocab_start_index], dtype=torch.int64)
    if tp_group is not None and group_size(tp_group) > 1:
        dist.all_reduce(width_total, group=tp_group)
    k = int(min(k, max(1, int(width_total))))
    return vocab_parallel_topk(
        vocab_parallel_logits,
        k,
        tp_group,
        vocab_start_index=vocab_start_index,
        vocab_end_index=vocab_end_index,
        out_dtype=torch.float32,
    )


def gather_logits_at_global_indices(
    vocab_parallel_logits: torch.Tensor,
    global_indices: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
    *,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """NeMo RL's: the logits at global ids, ``[B, S, k]`` fp32, differentiable.

    ``vocab_parallel_logits`` ``[B, S/cp, V/tp]`` (with ``cp_group``: this rank's load-balanced
    pieces), ``global_indices`` ``[B, S, k]`` over the full sequence (``S`` up to the logits' ``S``).
    An id in no rank's slice gives 0. The result is replicated over the TP and CP groups and meant to
    be used identically there: its gradient reaches each rank's own columns and positions once.
    Communication: one all-reduce of ``[B, S/cp, k]`` fp32 over ``tp_group``, one all-gather over
    ``cp_group``. ``chunk_size`` is accepted and not needed (only ``[B, S/cp, k]`` is materialized).
    """
    del chunk_size
    cp = 1 if cp_group is None else group_size(cp_group)
    local_len = vocab_parallel_logits.shape[1]
    full_len = global_indices.shape[1]
    if full_len > local_len * cp:
        raise ValueError(
            f"gather_logits_at_global_indices: global_indices cover {full_len} positions, the logits "
            f"{local_len} per rank x {cp} context-parallel ranks"
        )
    bounds = segment_bounds(None, local_len * cp)
    indices = global_indices
    if full_len < local_len * cp:
        pad = indices.new_zeros((indices.shape[0], local_len * cp - full_len, *indices.shape[2:]))
        indices = torch.cat([indices, pad], dim=1)
    if cp > 1:
        rank = dist.get_rank(cp_group)
        indices = indices.index_select(1, context_parallel_positions(bounds, cp, rank, indices.device))
    width = vocab_parallel_logits.shape[-1]
    in_range = (indices >= vocab_start_index) & (indices < vocab_end_index)
    local_index = (indices - vocab_start_index).clamp(0, max(0, width - 1))
    values = vocab_parallel_logits.gather(-1, local_index).float()
    values = torch.where(in_range, values, torch.zeros_like(values))
    if tp_group is not None:
        values = reduce_from_region(values, tp_group)
    # [B, S/cp, k] -> [B, k, S/cp] so that the sequence is last for the CP gather, and back
    values = gather_context_parallel(values.transpose(1, 2), bounds, cp_group).transpose(1, 2)
    return values[:, :full_len]


__all__ = [
    "apply_top_k_top_p",
    "distributed_vocab_topk",
    "gather_logits_at_global_indices",
    "vocab_parallel_sampling_logprobs",
    "vocab_parallel_top_k_top_p_mask",
]
