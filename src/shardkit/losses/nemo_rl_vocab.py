"""NeMo RL's vocab-parallel helpers (``nemo_rl.distributed.model_utils``), by name and signature.

Thin faces over shardkit's computations (even vocabulary shards over ``tp_group``: rank ``r`` holds
``[r * V/tp, (r + 1) * V/tp)``; ``tp_group`` None or one rank: the logits are the whole vocabulary;
a DTensor is taken as its local shard, as NeMo RL does):

- ``vocab_parallel_log_softmax(logits, temperature, *, tp_group=None)``: fp32 ``log_softmax(logits /
  temperature)`` over the whole vocabulary, kept sharded ``[..., V/tp]`` (differentiable).
- ``vocab_parallel_full_log_softmax(...)``: the same gathered to ``[..., V]`` on every rank (backward
  keeps this rank's columns, as Megatron's gather does).
- ``vocab_parallel_gather_columns(logits [B, T, V/tp], column_indices [K], *, tp_group=None)``: fp32
  ``[B, T, K]`` logits at global columns (differentiable), via ``gather_logits_at_global_indices``.
- ``DistributedCrossEntropy.apply(student_logits, target_logits, group, inference_only=False)``:
  soft-target cross-entropy ``-sum_v p_target(v) log q_student(v)`` fp32 ``[...]``; the gradient
  flows to the student logits only (``q - p``).
- ``DistributedLogprobWithSampling.apply(logits, target, tp_group, top_k, top_p,
  inference_only=False)`` and ``ChunkedDistributedLogprobWithSampling.apply(logits, target, tp_group,
  top_k, top_p, chunk_size, inference_only=False)``: ``vocab_parallel_sampling_logprobs`` (log-probs
  under the top-k / top-p filtered distribution) under NeMo RL's names; ``chunk_size`` counts sequence
  positions of ``[B, S, V/tp]`` logits, as in NeMo RL.

The classes are not ``torch.autograd.Function`` subclasses: ``apply`` runs shardkit's differentiable
computation (``inference_only`` or no grad: nothing saved for backward).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from shardkit.distributed.agreement import group_rank, group_size
from shardkit.distributed.regions import gather_from_region, reduce_from_region
from shardkit.losses.dtensor import is_dtensor
from shardkit.losses.log_softmax import distributed_log_softmax
from shardkit.losses.sampling import gather_logits_at_global_indices, vocab_parallel_sampling_logprobs


def _sharded(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and group_size(group) > 1


def _local(logits: torch.Tensor) -> torch.Tensor:
    return logits.to_local() if is_dtensor(logits) else logits


def _log_softmax(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    return distributed_log_softmax(x, group) if _sharded(group) else torch.log_softmax(x, dim=-1)


def vocab_parallel_log_softmax(
    logits: torch.Tensor, temperature: float, *, tp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """fp32 ``[..., V/tp]`` log-probabilities of ``logits / temperature`` (see the module doc)."""
    return _log_softmax(_local(logits).float() / temperature, tp_group)


def vocab_parallel_full_log_softmax(
    logits: torch.Tensor, temperature: float, *, tp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """fp32 ``[..., V]`` log-probabilities, gathered over ``tp_group`` (see the module doc)."""
    sharded = vocab_parallel_log_softmax(logits, temperature, tp_group=tp_group)
    return gather_from_region(sharded, -1, tp_group) if _sharded(tp_group) else sharded


def vocab_parallel_gather_columns(
    logits: torch.Tensor, column_indices: torch.Tensor, *, tp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """fp32 ``[B, T, K]``: the logits at the global columns ``column_indices`` ``[K]``."""
    logits = _local(logits)
    if not _sharded(tp_group):
        return logits[..., column_indices].float()
    width = logits.shape[-1]
    start = group_rank(tp_group) * width
    batch, seq, _ = logits.shape
    indices = column_indices.view(1, 1, -1).expand(batch, seq, -1)
    return gather_logits_at_global_indices(
        logits, indices, tp_group=tp_group, vocab_start_index=start, vocab_end_index=start + width
    )


class DistributedCrossEntropy:
    """NeMo RL's soft-target cross-entropy over a sharded vocabulary (see the module doc)."""

    @staticmethod
    def apply(
        student_logits: torch.Tensor,
        target_logits: torch.Tensor,
        group: Optional[dist.ProcessGroup],
        inference_only: bool = False,
    ) -> torch.Tensor:
        if student_logits.shape != target_logits.shape:
            raise ValueError(
                "DistributedCrossEntropy: student_logits and target_logits must have the same shape, "
                f"got {tuple(student_logits.shape)} and {tuple(target_logits.shape)}"
            )
        with torch.no_grad():
            target_probs = _log_softmax(target_logits.float(), group).exp_()
        if inference_only:
            with torch.no_grad():
                return DistributedCrossEntropy._loss(student_logits, target_probs, group)
        return DistributedCrossEntropy._loss(student_logits, target_probs, group)

    @staticmethod
    def _loss(student_logits, target_probs, group) -> torch.Tensor:
        log_q = _log_softmax(student_logits.float(), group)
        local = -(target_probs * log_q).sum(-1)
        return reduce_from_region(local, group) if _sharded(group) else local


class DistributedLogprobWithSampling:
    """NeMo RL's name for ``vocab_parallel_sampling_logprobs`` over even shards (module doc)."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: Optional[dist.ProcessGroup],
        top_k: Optional[int],
        top_p: float,
        inference_only: bool = False,
    ) -> torch.Tensor:
        return vocab_parallel_sampling_logprobs(
            vocab_parallel_logits, target, top_k, top_p, tp_group, inference_only=inference_only
        )


class ChunkedDistributedLogprobWithSampling:
    """``DistributedLogprobWithSampling`` worked in blocks of ``chunk_size`` sequence positions."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: Optional[dist.ProcessGroup],
        top_k: Optional[int],
        top_p: float,
        chunk_size: int,
        inference_only: bool = False,
    ) -> torch.Tensor:
        if not (isinstance(chunk_size, int) and chunk_size >= 1):
            raise ValueError(
                "ChunkedDistributedLogprobWithSampling: chunk_size must be a positive int, "
                f"got {chunk_size!r}"
            )
        batch = vocab_parallel_logits.shape[0] if vocab_parallel_logits.dim() >= 3 else 1
        return vocab_parallel_sampling_logprobs(
            vocab_parallel_logits,
            target,
            top_k,
            top_p,
            tp_group,
            inference_only=inference_only,
            chunk_size=chunk_size * max(1, batch),
        )


__all__ = [
    "ChunkedDistributedLogprobWithSampling",
    "DistributedCrossEntropy",
    "DistributedLogprobWithSampling",
    "vocab_parallel_full_log_softmax",
    "vocab_parallel_gather_columns",
    "vocab_parallel_log_softmax",
]
