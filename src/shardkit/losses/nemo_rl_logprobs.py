"""NeMo RL's log-prob entry points and layout exchanges (``nemo_rl.distributed.model_utils``), by name.

- ``ChunkedDistributedGatherLogprob.apply(logits [B, S, V/tp], global_indices [B, S, K],
  vocab_start_index, vocab_end_index, chunk_size, tp_group, inference_only=False)``: fp32 ``[B, S, K]``
  log-probabilities (over the whole vocabulary) at global ids; differentiable. Computed as
  ``distributed_log_softmax`` then ``gather_logits_at_global_indices``: the fp32 log-softmax of the
  shard is materialized once (NeMo RL recomputes it per chunk of ``chunk_size`` positions instead).
- ``get_next_token_logprobs_from_logits(input_ids [B, S], next_token_logits [B, S(/cp), V(/tp)],
  seq_index=None, vocab_parallel_rank=None, vocab_parallel_group=None, context_parallel_group=None,
  sampling_params=None, chunk_size=None, cp_sharder=None)``: fp32 ``[B, S - 1]`` next-token
  log-probs: vocab-parallel (even shards, rank ``vocab_parallel_rank``) through
  ``from_parallel_logits_to_logprobs`` (with ``context_parallel_group``, the gradient is summed over
  the CP ranks, NeMo RL's rule), a DTensor through its mesh, or plain logits on one rank.
- ``get_distillation_topk_logprobs_from_logits(student_logits, teacher_topk_logits,
  teacher_topk_indices, zero_outside_topk, calculate_entropy, vocab_parallel_rank=None,
  vocab_parallel_group=None, context_parallel_group=None, cp_sharder=None)``: ``(student [B, S-1, K],
  teacher [B, S-1, K], H [B, S-1] or None)``: the student's log-probs at the teacher's top-k ids (over
  the whole vocabulary with ``zero_outside_topk``, else renormalized over the k), the teacher's
  renormalized over its k, and ``H = sum_v p log p`` (the negative entropy, NeMo RL's sign).
- ``all_to_all_vp2sq(x [BS, V/tp], tp_group) -> [BS/tp, V]`` and ``all_to_all_sq2vp(x [BS/tp, V],
  tp_group) -> [BS, V/tp]``: vocabulary-split rows <-> row-split full vocabulary (rank ``r`` gets rows
  ``[r * BS/tp, (r + 1) * BS/tp)``), one all-to-all each; not differentiable (as in NeMo RL).

Automodel's ``cp_sharder`` and the V1 DTensor worker's ``seq_index`` are not supported: passing one
raises ``ValueError`` rather than being ignored.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_rank, group_size
from shardkit.losses.dtensor import is_dtensor
from shardkit.losses.log_softmax import distributed_log_softmax
from shardkit.losses.nemo_rl_cp import _get_tokens_on_this_cp_rank, allgather_cp_sharded_tensor
from shardkit.losses.next_token import from_parallel_logits_to_logprobs
from shardkit.losses.rl_helpers import vocab_parallel_entropy
from shardkit.losses.sampling import apply_top_k_top_p, gather_logits_at_global_indices


def _sharded(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and group_size(group) > 1


def _log_softmax(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    return distributed_log_softmax(x, group) if _sharded(group) else torch.log_softmax(x, dim=-1)


class ChunkedDistributedGatherLogprob:
    """NeMo RL's gathered log-probs at global ids (see the module doc); not an autograd.Function."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        global_indices: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int,
        tp_group: Optional[dist.ProcessGroup],
        inference_only: bool = False,
    ) -> torch.Tensor:
        if not (isinstance(chunk_size, int) and chunk_size >= 1):
            raise ValueError(
                f"ChunkedDistributedGatherLogprob: chunk_size must be a positive int, got {chunk_size!r}"
            )
        with torch.set_grad_enabled(torch.is_grad_enabled() and not inference_only):
            log_probs = _log_softmax(vocab_parallel_logits.float(), tp_group)
            return gather_logits_at_global_indices(
                log_probs,
                global_indices,
                tp_group if _sharded(tp_group) else None,
                vocab_start_index=vocab_start_index,
                vocab_end_index=vocab_end_index,
            )


def _unsupported(op: str, cp_sharder: Any, seq_index: Any = None) -> None:
    if cp_sharder is not None:
        raise ValueError(f"{op}: Automodel's cp_sharder is not supported by shardkit; pass cp groups instead")
    if seq_index is not None:
        raise ValueError(f"{op}: seq_index (the V1 DTensor worker's CP layout) is not supported by shardkit")


def get_next_token_logprobs_from_logits(
    input_ids: torch.Tensor,
    next_token_logits: torch.Tensor,
    seq_index: Optional[torch.Tensor] = None,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group: Optional[dist.ProcessGroup] = None,
    context_parallel_group: Optional[dist.ProcessGroup] = None,
    sampling_params: Any = None,
    chunk_size: Optional[int] = None,
    cp_sharder: Any = None,
) -> torch.Tensor:
    """fp32 ``[B, S - 1]``: ``log p(input_ids[:, t + 1] | logits[:, t])`` (see the module doc)."""
    op = "get_next_token_logprobs_from_logits"
    _unsupported(op, cp_sharder, seq_index)
    if vocab_parallel_group is not None:
        if vocab_parallel_rank is None:
            raise ValueError(f"{op}: vocab_parallel_rank must be given with vocab_parallel_group")
        width = next_token_logits.shape[-1]
        logprobs = from_parallel_logits_to_logprobs(
            next_token_logits,
            input_ids,
            vocab_start_index=vocab_parallel_rank * width,
            vocab_end_index=(vocab_parallel_rank + 1) * width,
            tp_group=vocab_parallel_group,
            cp_group=context_parallel_group,
            sampling_params=sampling_params,
            chunk_size=chunk_size,
            cp_gradient="sum",  # NeMo RL's CP gather sums the gradient over the CP ranks
        )
        return logprobs[:, : input_ids.shape[1] - 1]
    if is_dtensor(next_token_logits):
        return from_parallel_logits_to_logprobs(
            next_token_logits, input_ids, None, None, sampling_params=sampling_params, chunk_size=chunk_size
        )
    logits = next_token_logits[:, :-1].float()
    top_k = getattr(sampling_params, "top_k", None) if sampling_params is not None else None
    top_p = getattr(sampling_params, "top_p", 1.0) if sampling_params is not None else 1.0
    logits, _ = apply_top_k_top_p(logits, top_k=top_k, top_p=top_p)
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None].to(logits.device)).squeeze(-1)


def _cp_local(indices, local_len, cp_group):
    """Pad ``[B, S, K]`` ids to ``local_len * cp`` positions and keep this CP rank's pieces."""
    cp = group_size(cp_group)
    pad = local_len * cp - indices.shape[1]
    if pad > 0:
        indices = torch.nn.functional.pad(indices, (0, 0, 0, pad), value=0)
    return _get_tokens_on_this_cp_rank(indices, group_rank(cp_group), cp, seq_dim=1), max(pad, 0)


def get_distillation_topk_logprobs_from_logits(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group: Optional[dist.ProcessGroup] = None,
    context_parallel_group: Optional[dist.ProcessGroup] = None,
    cp_sharder: Any = None,
):
    """``(student_topk_logprobs, teacher_topk_logprobs, H or None)`` (see the module doc)."""
    op = "get_distillation_topk_logprobs_from_logits"
    _unsupported(op, cp_sharder)
    if teacher_topk_indices.shape[-1] <= 0:
        raise ValueError(f"{op}: topk must be positive, got {teacher_topk_indices.shape[-1]}")
    cp_group = context_parallel_group
    group, start, end = None, 0, None
    if vocab_parallel_group is not None:
        if vocab_parallel_rank is None:
            raise ValueError(f"{op}: vocab_parallel_rank must be given with vocab_parallel_group")
        group = vocab_parallel_group
    elif is_dtensor(student_logits):
        mesh = student_logits.device_mesh
        group = mesh.get_group("tp")
        vocab_parallel_rank = group_rank(group)
        names = mesh.mesh_dim_names or ()
        cp_group = mesh.get_group("cp") if "cp" in names else None
        student_logits = student_logits.to_local()
    student = student_logits.float()
    width = student.shape[-1]
    if group is not None:
        start, end = vocab_parallel_rank * width, (vocab_parallel_rank + 1) * width
    indices = teacher_topk_indices.to(student.device)
    cp_size = group_size(cp_group) if cp_group is not None else 1
    entropy = None
    if zero_outside_topk and group is not None:
        pad = 0
        if cp_size > 1:
            indices, pad = _cp_local(indices, student.shape[1], cp_group)
        chunk = max(1, min(int(student.shape[1]), 1024))
        student_topk = ChunkedDistributedGatherLogprob.apply(student, indices, start, end, chunk, group)
        if calculate_entropy:
            entropy = -vocab_parallel_entropy(student, group, vocab_start_index=start, vocab_end_index=end)
        if cp_size > 1:
            student_topk = allgather_cp_sharded_tensor(student_topk, cp_group, seq_dim=1)
            entropy = None if entropy is None else allgather_cp_sharded_tensor(entropy, cp_group, seq_dim=1)
            if pad:
                student_topk = student_topk[:, :-pad]
                entropy = None if entropy is None else entropy[:, :-pad]
    elif zero_outside_topk:  # one rank holds the whole vocabulary (NeMo RL: no CP handling here)
        log_probs = torch.log_softmax(student, -1)
        student_topk = log_probs.gather(-1, indices)
        if calculate_entropy:
            entropy = (log_probs.exp() * log_probs).sum(-1)
    else:
        local_indices, pad = indices, 0
        if cp_size > 1:
            local_indices, pad = _cp_local(indices, student.shape[1], cp_group)
        if group is not None:
            gathered = gather_logits_at_global_indices(
                student, local_indices, tp_group=group, vocab_start_index=start, vocab_end_index=end
            )
        else:
            gathered = student.gather(-1, local_indices)
        if cp_size > 1:  # NeMo RL's CP gather: the gradient summed over the CP ranks
            gathered = allgather_cp_sharded_tensor(gathered, cp_group, seq_dim=1)
            gathered = gathered[:, : gathered.shape[1] - pad]
        student_topk = torch.log_softmax(gathered, -1)
    teacher = torch.log_softmax(teacher_topk_logits.to(student_topk.device, student_topk.dtype), -1)
    if calculate_entropy and entropy is not None:
        entropy = entropy[:, :-1]
    return student_topk[:, :-1], teacher[:, :-1], entropy


def all_to_all_vp2sq(
    vocab_parallel_logits: torch.Tensor, tp_group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """``[BS, V/tp]`` (every row, this rank's columns) -> ``[BS/tp, V]`` (this rank's rows, all columns)."""
    tp = group_size(tp_group) if tp_group is not None else 1
    if tp == 1:
        return vocab_parallel_logits
    rows, width = vocab_parallel_logits.shape
    if rows % tp:
        raise ValueError(f"all_to_all_vp2sq: {rows} rows cannot be split evenly over {tp} ranks")
    received = torch.empty_like(vocab_parallel_logits, memory_format=torch.contiguous_format)
    dist.all_to_all_single(received, vocab_parallel_logits.contiguous(), group=tp_group)
    # received: rank i's columns of my rows, rank by rank -> [rows/tp, tp * width]
    return received.view(tp, rows // tp, width).permute(1, 0, 2).reshape(rows // tp, tp * width)


def all_to_all_sq2vp(
    seq_parallel_logits: torch.Tensor, tp_group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """``[BS/tp, V]`` (this rank's rows, all columns) -> ``[BS, V/tp]`` (every row, this rank's columns)."""
    tp = group_size(tp_group) if tp_group is not None else 1
    if tp == 1:
        return seq_parallel_logits
    rows, vocab = seq_parallel_logits.shape
    if vocab % tp:
        raise ValueError(f"all_to_all_sq2vp: {vocab} columns cannot be split evenly over {tp} ranks")
    send = seq_parallel_logits.view(rows, tp, vocab // tp).permute(1, 0, 2).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=tp_group)
    return received.view(tp * rows, vocab // tp)


__all__ = [
    "ChunkedDistributedGatherLogprob",
    "all_to_all_sq2vp",
    "all_to_all_vp2sq",
    "get_distillation_topk_logprobs_from_logits",
    "get_next_token_logprobs_from_logits",
]
