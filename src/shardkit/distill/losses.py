"""Chunk-level distillation losses across tokenizers, and their combination with the student's cross-entropy.

Shapes: student logits ``[B, T_s, V_s/tp]`` (this rank's vocabulary slice; ``tp = 1``: the whole
vocabulary), teacher logits ``[B, T_t, V_t']`` (``V_t'`` may exceed the real teacher vocabulary
``V_t``: the model's padded columns are dropped), an ``AlignmentBatch`` of ``C`` chunk pairs.

Next-token shift: the distribution at position ``i`` predicts token ``i + 1``, so position ``i`` is
counted in the chunk of token ``i + 1`` (the last position in none; equivalent to dropping it and
using ``chunk_id[:, 1:]``): a chunk collects the predictions *of its tokens*.

Normalization: a chunk is valid when both sides are non-empty, the pair is valid (and, with
``exact_token_match_only``, its texts are equal) and its sample's ``sample_mask`` is set. Every loss
is ``sum over valid chunks / N`` where ``N`` is the number of valid chunks of the *global* batch,
summed over ``dp_group`` with ``dp_all_reduce_sum``. With ``dp_group`` the sum is all-reduced too,
so every rank returns the global value, and each rank's gradient is its own chunks' part of it
(the convention of ``shardkit.losses``): summing the ranks' gradients (DDP's sum, or its mean
times dp) gives the gradient of the global batch. No valid chunk anywhere: the loss is 0, with a
zero gradient.

Vocab-parallel student (``tp_group`` of more than one rank): log-softmax over the sharded
vocabulary (``shardkit.losses.distributed_log_softmax``); each rank projects its own vocabulary
rows and the partial projections are summed (``reduce_from_region``); common-vocabulary columns are
assembled the same way; the uncommon tail's top-k is taken per rank, all-gathered and re-ranked.
The result (value and every rank's shard gradient) equals the unsharded computation.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from shardkit.distill.alignment_batch import AlignmentBatch
from shardkit.distill.chunks import chunk_average_log_probs, valid_chunk_mask
from shardkit.distill.counts import dp_all_reduce_sum
from shardkit.distill.sparse_mm import Fp32SparseMM
from shardkit.distributed.agreement import assert_same_on_all_ranks, group_rank, group_size
from shardkit.distributed.regions import gather_from_region, reduce_from_region
from shardkit.distributed.validation import validation_enabled
from shardkit.losses import distributed_log_softmax, vocab_parallel_cross_entropy

Group = Optional[dist.ProcessGroup]
# Keeps the log of a renormalized projected probability finite where the projection put no mass.
EPS = 1e-10


def _vocab_slice(
    logits: torch.Tensor, group: Group, start: Optional[int], end: Optional[int]
) -> Tuple[int, int]:
    width = logits.size(-1)
    if start is None and end is None:
        start = group_rank(group) * width if group_size(group) > 1 else 0
        end = start + width
    if start is None or end is None or end - start != width:
        raise ValueError(
            f"the student vocabulary slice [{start}, {end}) does not match the logits shard width {width} "
            f"(give both vocab_start_index and vocab_end_index, or neither for even shards)"
        )
    return int(start), int(end)


def _check_common(student_logits, teacher_logits, alignment: AlignmentBatch, sample_mask, what: str):
    if student_logits.dim() != 3 or teacher_logits.dim() != 3:
        raise ValueError(
            f"{what}: logits must be [B, T, V]; got student {tuple(student_logits.shape)}, "
            f"teacher {tuple(teacher_logits.shape)}"
        )
    b = student_logits.size(0)
    expect = {
        "teacher_logits": (teacher_logits.shape[:1], (b,)),
        "alignment.student_chunk_id": (alignment.student_chunk_id.shape, student_logits.shape[:2]),
        "alignment.teacher_chunk_id": (alignment.teacher_chunk_id.shape, teacher_logits.shape[:2]),
        "alignment.pair_valid": (alignment.pair_valid.shape[:1], (b,)),
        "alignment.pair_is_correct": (alignment.pair_is_correct.shape, alignment.pair_valid.shape),
    }
    if sample_mask is not None:
        expect["sample_mask"] = (sample_mask.shape, (b,))
    for name, (got, want) in expect.items():
        if tuple(got) != tuple(want):
            raise ValueError(f"{what}: {name} has shape {tuple(got)}, expected {tuple(want)}")
    if student_logits.size(1) < 2 or teacher_logits.size(1) < 2:
        raise ValueError(
            f"{what}: next-token distillation needs sequences of at least 2 positions on both sides"
        )


def _next_token_chunk_ids(chunk_id: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``[B, T]``: position ``i`` gets the chunk of token ``i + 1`` (the token it predicts), the last -1.

    The same as dropping the last prediction and using ``chunk_id[:, 1:]``, without slicing the
    ``[B, T, V]`` predictions (a slice of them would cost a copy in the chunk reduction).
    """
    chunk_id = chunk_id.to(device=device, dtype=torch.long)
    last = torch.full_like(chunk_id[:, :1], -1)
    return torch.cat([chunk_id[:, 1:], last], dim=1)


def _valid_chunks(s_sizes, t_sizes, pair_valid, sample_mask):
    valid = valid_chunk_mask(s_sizes, t_sizes, pair_valid)
    if sample_mask is not None:
        valid = valid & sample_mask.bool().to(valid.device).unsqueeze(1)
    return valid


def _global_mean(
    per_chunk: torch.Tensor, valid: torch.Tensor, dp_group: Group
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sum of per_chunk over valid chunks of every dp rank / global count, global count)``."""
    local_count = valid.sum()
    count = local_count.float() if dp_group is None else dp_all_reduce_sum(local_count, dp_group)
    # torch.where, not a product: an invalid chunk's value must not leak as inf * 0 = NaN
    total = torch.where(valid, per_chunk, torch.zeros_like(per_chunk)).sum()
    if dp_group is not None:
        total = reduce_from_region(total, dp_group)
    return total / count.to(total.device, total.dtype).clamp(min=1.0), count


def _kl(log_p_target: torch.Tensor, log_q: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Per-chunk ``KL(target || q)`` over the last dim (``reverse``: ``KL(q || target)``)."""
    if reverse:
        return (log_q.exp() * (log_q - log_p_target)).sum(-1)
    return (log_p_target.exp() * (log_p_target - log_q)).sum(-1)


def projection_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    alignment: AlignmentBatch,
    projection: torch.Tensor,
    *,
    vocab_topk: int,
    temperature: float = 1.0,
    reverse_kl: bool = False,
    exact_token_match_only: bool = False,
    sample_mask: Optional[torch.Tensor] = None,
    tp_group: Group = None,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    dp_group: Group = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Chunk-level KL between the teacher and the student projected onto a top-k teacher sub-vocabulary.

    Per chunk ``c`` (after the next-token shift; ``K`` the top-k teacher ids, ``tau`` the temperature):

    - ``K``: the ``vocab_topk`` teacher ids with the largest logit anywhere in the batch (positions in
      a chunk; max over the dp group too, so every rank uses the same ``K``), ascending;
    - student: ``q_i = softmax(z_s / tau) @ M[:, K]`` per position (``M`` the sparse projection, in fp32
      through ``Fp32SparseMM``), averaged over the chunk's positions, renormalized over ``K``:
      ``log Q_c = log(mean_c(q) / sum_K mean_c(q) + eps)``;
    - teacher: ``log P_c = mean_c(log_softmax(z_t[K] / tau))`` (the chunk-average of log-probs);
    - ``KL_c = sum_K exp(log P_c) (log P_c - log Q_c)`` (``reverse_kl``: the roles swapped).

    ``loss = tau**2 * sum_valid KL_c / N`` (see the module doc for ``N`` and the groups).

    Args:
        student_logits: ``[B, T_s, V_s/tp]`` any float dtype (computed in fp32).
        teacher_logits: ``[B, T_t, V_t']``; columns past ``projection.size(1)`` are ignored.
        projection: sparse ``[V_s, V_t]`` (``get_sparse_projection_matrix``), ``V_s`` at least the
            student's (padded) vocabulary.
        vocab_topk: ``k`` (clamped to the teacher vocabulary).
        sample_mask: ``[B]`` (0 drops a sample) or None.
        tp_group: the student's vocabulary group (None: the default group); ``vocab_start_index`` /
            ``vocab_end_index``: this rank's slice (default: even shards).
        dp_group: the data-parallel group over which chunks are counted (None: this rank alone).
    Returns:
        ``(loss, metrics)``: fp32 scalar; metrics (detached): ``num_valid_chunks`` (this rank),
        ``global_valid_chunks``, ``proj_accuracy`` (share of this rank's valid chunks where the
        argmax of ``Q_c`` and ``P_c`` agree).
    """
    what = "projection_kl_loss"
    _check_common(student_logits, teacher_logits, alignment, sample_mask, what)
    if projection.layout != torch.sparse_coo or projection.dim() != 2:
        raise ValueError(f"{what}: projection must be a 2-D sparse COO matrix [V_s, V_t]")
    if int(vocab_topk) < 1 or not temperature > 0:
        raise ValueError(
            f"{what}: need vocab_topk >= 1 and temperature > 0, got {vocab_topk} and {temperature}"
        )
    start, end = _vocab_slice(student_logits, tp_group, vocab_start_index, vocab_end_index)
    if end > projection.size(0):
        raise ValueError(
            f"{what}: the projection has {projection.size(0)} student rows but this rank's vocabulary "
            f"slice is [{start}, {end}); size it with student_vocab_size >= the student's vocabulary"
        )
    tau = float(temperature)
    v_t = min(projection.size(1), teacher_logits.size(-1))
    t_cid = _next_token_chunk_ids(alignment.teacher_chunk_id, teacher_logits.device)
    s_cid = _next_token_chunk_ids(alignment.student_chunk_id, student_logits.device)
    teacher = teacher_logits[..., :v_t]  # a view: the full teacher logits are never copied
    with torch.no_grad():
        importance = torch.full((v_t,), -math.inf, dtype=torch.float32, device=teacher.device)
        for i in range(teacher.size(0)):  # one sample's in-chunk rows at a time bounds the peak memory
            rows_i = teacher[i][t_cid[i] >= 0]
            if rows_i.size(0):
                importance = torch.maximum(importance, rows_i.amax(0).float())
        if dp_group is not None and group_size(dp_group) > 1:
            if validation_enabled():
                # a rank with another teacher vocabulary would mismatch the all-reduce below
                assert_same_on_all_ranks(
                    (v_t, int(vocab_topk)), "projection_kl_loss (teacher vocabulary, vocab_topk)", dp_group
                )
            dist.all_reduce(importance, op=dist.ReduceOp.MAX, group=dp_group)
        top = torch.topk(importance, min(int(vocab_topk), v_t)).indices.sort().values  # [k]
    # student side: project only the k selected teacher columns of this rank's vocabulary rows;
    # every position is projected (the last one falls in no chunk) so that nothing is sliced or copied
    log_probs = distributed_log_softmax(student_logits.float() / tau, tp_group)
    b, t_s, v_loc = log_probs.shape
    rows = projection
    if (start, end) != (0, projection.size(0)):
        rows = rows.index_select(0, torch.arange(start, end, device=projection.device))
    rows = rows.index_select(1, top.to(projection.device)).coalesce()
    flat = log_probs.exp().reshape(b * t_s, v_loc)
    projected = Fp32SparseMM.apply(rows, flat.t()).t().reshape(b, t_s, -1)  # [B, T_s, k]
    if group_size(tp_group) > 1:
        projected = reduce_from_region(projected.contiguous(), tp_group)
    c = alignment.pair_valid.size(1)
    proj_chunks, s_sizes = chunk_average_log_probs(projected, s_cid, c)
    proj_chunks = proj_chunks / (proj_chunks.sum(-1, keepdim=True) + EPS)
    proj_log = (proj_chunks + EPS).log()
    target = torch.log_softmax(teacher[..., top.to(teacher.device)].float() / tau, dim=-1)
    tgt_log, t_sizes = chunk_average_log_probs(target, t_cid, c)
    pair_valid = alignment.pair_valid.to(proj_log.device)
    if exact_token_match_only:
        pair_valid = pair_valid & alignment.pair_is_correct.to(proj_log.device)
    valid = _valid_chunks(s_sizes, t_sizes.to(s_sizes.device), pair_valid, sample_mask)
    per_chunk = _kl(tgt_log.to(proj_log.device), proj_log, reverse_kl)
    loss, count = _global_mean(per_chunk, valid, dp_group)
    with torch.no_grad():
        agree = (proj_log.argmax(-1) == tgt_log.to(proj_log.device).argmax(-1)) & valid
        accuracy = agree.sum() / valid.sum().clamp(min=1)
    metrics = {
        "num_valid_chunks": valid.sum().detach(),
        "global_valid_chunks": count.detach(),
        "proj_accuracy": accuracy.float(),
    }
    return loss * (tau * tau), metrics


def _select_columns(
    chunks: torch.Tensor, ids: torch.Tensor, start: int, end: int, tp_group: Group
) -> torch.Tensor:
    """``full[..., ids]`` of the vocabulary-sharded ``chunks [..., V/tp]``, on every rank, differentiable.

    Each rank fills the requested columns it owns and zeros elsewhere; an all-reduce sums the pieces
    (backward: each rank's gradient flows to its own columns only).
    """
    if group_size(tp_group) == 1:
        return chunks[..., ids - start]
    mine = (ids >= start) & (ids < end)
    out = chunks.new_zeros(*chunks.shape[:-1], ids.numel())
    out = out.index_copy(-1, torch.nonzero(mine).squeeze(1), chunks[..., ids[mine] - start])
    return reduce_from_region(out, tp_group)


def _sorted_top(probs: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest values of each row, descending (``k <= probs.size(-1)``)."""
    return torch.topk(probs, k, dim=-1).values


def gold_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    alignment: AlignmentBatch,
    exact_map: Mapping[str, torch.Tensor],
    *,
    teacher_vocab_size: int,
    temperature: float = 1.0,
    reverse_kl: bool = False,
    uncommon_topk: int = 8192,
    sample_mask: Optional[torch.Tensor] = None,
    tp_group: Group = None,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    dp_group: Group = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Gold loss: KL on the exact-map common vocabulary plus sorted-L1 on the uncommon rest, per chunk.

    With ``S_c = mean_c(log_softmax(z_s / tau))`` over the whole student vocabulary and
    ``T_c = mean_c(log_softmax(z_t[:V_t] / tau))`` (after the next-token shift):

    - ``kl_common = sum_valid KL(T_c[common_teacher] || S_c[common_student]) / N`` (the sums are
      over the common columns, not renormalized; ``reverse_kl`` swaps the roles);
    - ``l1_uncommon = sum_valid sum_j |sort(exp S_c[us])_j - sort(exp T_c[ut])_j| / N`` (``us`` /
      ``ut``: the uncommon student / teacher ids) over the ``m = min(#us, #ut, uncommon_topk)``
      largest values of each side, sorted in descending order;
    - ``loss = tau**2 * (kl_common + l1_uncommon)``.

    Args:
        exact_map: from ``build_exact_token_map`` (its ``teacher_vocab_size`` must be the one here).
        teacher_vocab_size: ``V_t``; teacher logit columns past it are dropped.
        Others: as ``projection_kl_loss``.
    Returns:
        ``(loss, metrics)``: metrics (detached) ``kl_common``, ``l1_uncommon``, ``num_valid_chunks``,
        ``global_valid_chunks``, ``accuracy`` (argmax agreement on the common columns).
    """
    what = "gold_loss"
    _check_common(student_logits, teacher_logits, alignment, sample_mask, what)
    if not temperature > 0 or int(uncommon_topk) < 1:
        raise ValueError(
            f"{what}: need temperature > 0 and uncommon_topk >= 1, got {temperature}, {uncommon_topk}"
        )
    if teacher_logits.size(-1) < teacher_vocab_size:
        raise ValueError(
            f"{what}: teacher logits have {teacher_logits.size(-1)} columns, fewer than teacher_vocab_size "
            f"{teacher_vocab_size}"
        )
    start, end = _vocab_slice(student_logits, tp_group, vocab_start_index, vocab_end_index)
    device = student_logits.device
    cs, ct = exact_map["common_student"].to(device), exact_map["common_teacher"].to(device)
    us, ut = exact_map["uncommon_student"].to(device), exact_map["uncommon_teacher"].to(device)
    if ct.numel() + ut.numel() != teacher_vocab_size:
        raise ValueError(
            f"{what}: the exact map partitions {ct.numel() + ut.numel()} teacher ids, but "
            f"teacher_vocab_size is {teacher_vocab_size}; build it with the same teacher_vocab_size"
        )
    tau = float(temperature)
    c = alignment.pair_valid.size(1)
    s_log = distributed_log_softmax(student_logits.float() / tau, tp_group)
    t_log = torch.log_softmax(teacher_logits[..., :teacher_vocab_size].float() / tau, dim=-1).to(device)
    s_chunks, s_sizes = chunk_average_log_probs(
        s_log, _next_token_chunk_ids(alignment.student_chunk_id, device), c
    )
    t_chunks, t_sizes = chunk_average_log_probs(
        t_log, _next_token_chunk_ids(alignment.teacher_chunk_id, device), c
    )
    valid = _valid_chunks(s_sizes, t_sizes, alignment.pair_valid.to(device), sample_mask)

    s_common = _select_columns(s_chunks, cs, start, end, tp_group)
    t_common = t_chunks[..., ct]
    kl_common, count = _global_mean(_kl(t_common, s_common, reverse_kl), valid, dp_group)

    # uncommon tail: the m largest probabilities of each side, compared in sorted order
    n_us = us.numel()
    m = min(n_us, ut.numel(), int(uncommon_topk))
    if m > 0:
        mine = us[(us >= start) & (us < end)] - start
        s_probs = s_chunks[valid][:, mine].exp()  # [N_valid, this rank's uncommon columns]
        if group_size(tp_group) > 1:
            # per-rank top-m, padded with zeros (exp never reaches 0 where it matters: m <= n_us),
            # gathered and re-ranked: the same m values as a top-m over the whole vocabulary
            local = _sorted_top(s_probs, min(m, s_probs.size(-1)))
            local = torch.cat([local, local.new_zeros(local.size(0), m - local.size(-1))], dim=-1)
            s_sorted = _sorted_top(gather_from_region(local, -1, tp_group), m)
        else:
            s_sorted = _sorted_top(s_probs, m)
        t_sorted = _sorted_top(t_chunks[valid][:, ut].exp(), m)
        per_chunk = torch.zeros(valid.shape, dtype=s_sorted.dtype, device=device)
        per_chunk = per_chunk.masked_scatter(valid, (s_sorted - t_sorted).abs().sum(-1))
        l1_uncommon, _ = _global_mean(per_chunk, valid, dp_group)
    else:
        l1_uncommon = kl_common.new_zeros(())
    with torch.no_grad():
        agree = (s_common.argmax(-1) == t_common.argmax(-1)) & valid if cs.numel() else valid & False
        accuracy = agree.sum() / valid.sum().clamp(min=1)
    metrics = {
        "kl_common": kl_common.detach(),
        "l1_uncommon": l1_uncommon.detach(),
        "num_valid_chunks": valid.sum().detach(),
        "global_valid_chunks": count.detach(),
        "accuracy": accuracy.float(),
    }
    return (kl_common + l1_uncommon) * (tau * tau), metrics


def student_cross_entropy(
    student_logits: torch.Tensor,
    input_ids: torch.Tensor,
    token_mask: Optional[torch.Tensor] = None,
    *,
    sample_mask: Optional[torch.Tensor] = None,
    tp_group: Group = None,
    vocab_start_index: Optional[int] = None,
    vocab_end_index: Optional[int] = None,
    vocab_size: Optional[int] = None,
    dp_group: Group = None,
) -> torch.Tensor:
    """The student's own next-token cross-entropy, the mean over the global batch's counted tokens.

    ``student_logits [B, T_s, V_s/tp]``, ``input_ids [B, T_s]``; position ``i`` is scored against
    token ``i + 1`` when ``token_mask[:, i + 1]`` (default: all) and the sample's ``sample_mask`` are
    set. Computed by ``shardkit.losses.vocab_parallel_cross_entropy`` (vocab-parallel over
    ``tp_group``, counted over ``dp_group``); fp32 scalar, 0 when no token counts.
    """
    if input_ids.shape != student_logits.shape[:2]:
        raise ValueError(
            f"student_cross_entropy: input_ids shape {tuple(input_ids.shape)} != logits [B, T] "
            f"{tuple(student_logits.shape[:2])}"
        )
    ignore = -100
    # every position is scored (the last against ignore_index) so the logits are not sliced and copied
    ids = input_ids.to(student_logits.device)
    target = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], ignore)], dim=1)
    keep = torch.ones_like(target, dtype=torch.bool)
    keep[:, -1] = False
    if token_mask is not None:
        keep[:, :-1] &= token_mask[:, 1:].bool().to(keep.device)
    if sample_mask is not None:
        keep &= sample_mask.bool().to(keep.device).unsqueeze(1)
    target = torch.where(keep, target, torch.full_like(target, ignore))
    start, end = _vocab_slice(student_logits, tp_group, vocab_start_index, vocab_end_index)
    return vocab_parallel_cross_entropy(
        student_logits,
        target,
        tp_group,
        vocab_start_index=start,
        vocab_end_index=end,
        vocab_size=vocab_size,
        ignore_index=ignore,
        reduction="mean",
        dp_group=dp_group,
    )


def combine_with_cross_entropy(
    kd_loss: torch.Tensor,
    ce_loss: torch.Tensor,
    *,
    kl_loss_weight: float = 1.0,
    ce_loss_scale: float = 1.0,
    dynamic_loss_scaling: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(loss, kd_scale)``: ``kl_loss_weight * kd + ce_loss_scale * ce``, or with dynamic scaling
    ``sg(|ce| / |kd|) * kd + ce`` (the distillation term rescaled to the cross-entropy's magnitude,
    through a constant; scale 1 when ``kd`` is 0; the two weights are then ignored)."""
    if dynamic_loss_scaling:
        kd, ce = kd_loss.detach().abs(), ce_loss.detach().abs()
        scale = torch.where(kd > 0, ce / kd.clamp(min=torch.finfo(kd.dtype).tiny), torch.ones_like(kd))
        return scale * kd_loss + ce_loss, scale
    scale = torch.ones((), dtype=kd_loss.dtype, device=kd_loss.device)
    return kl_loss_weight * kd_loss + ce_loss_scale * ce_loss, scale
