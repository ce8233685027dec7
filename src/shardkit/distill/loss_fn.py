"""``CrossTokenizerDistillationLoss``: the configured loss of one training microbatch, from its data dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from shardkit.distill.alignment_batch import alignment_from_flat_batch
from shardkit.distill.exact_map import build_exact_token_map
from shardkit.distill.ipc import IPC_KEY, rebuild_teacher_full_logits_from_ipc
from shardkit.distill.losses import (
    Group,
    combine_with_cross_entropy,
    gold_loss,
    projection_kl_loss,
    student_cross_entropy,
)
from shardkit.distill.projection_files import get_sparse_projection_matrix


@dataclass(frozen=True)
class DistillationConfig:
    """What the loss computes.

    ``gold_loss=False``: the projection KL (needs any projection file); ``True``: the gold loss
    (needs the dense top-k file), with ``xtoken_loss`` choosing the relaxed exact-map rule
    (``xtoken_loss`` without ``gold_loss`` is an error). ``student_vocab_size``: the width of the
    student's (possibly padded) output layer; ``teacher_vocab_size``: the teacher tokenizer's size.
    The distillation term and the student's cross-entropy are combined by ``kl_loss_weight`` /
    ``ce_loss_scale``, or by ``dynamic_loss_scaling`` (see ``combine_with_cross_entropy``).
    """

    projection_matrix_path: str
    student_vocab_size: int
    teacher_vocab_size: int
    gold_loss: bool = False
    xtoken_loss: bool = False
    temperature: float = 1.0
    vocab_topk: int = 8192
    uncommon_topk: int = 8192
    reverse_kl: bool = False
    exact_token_match_only: bool = False
    kl_loss_weight: float = 1.0
    ce_loss_scale: float = 1.0
    dynamic_loss_scaling: bool = False

    def __post_init__(self) -> None:
        if self.xtoken_loss and not self.gold_loss:
            raise ValueError(
                "DistillationConfig: xtoken_loss=True requires gold_loss=True (it relaxes the gold loss's "
                "exact-token map and means nothing for the projection KL)"
            )


class CrossTokenizerDistillationLoss:
    """``loss(student_logits, data) -> (loss, metrics)`` for one microbatch.

    ``data`` holds ``input_ids [B, T_s]``, optionally ``token_mask [B, T_s]`` and ``sample_mask [B]``,
    the flat ``alignment_*`` tensors (``AlignmentBatch.to_flat_batch``) and, unless
    ``teacher_logits`` is passed, ``teacher_full_logits_ipc`` (``TeacherLogitsBuffer.entries``).
    Projection data come from the per-process caches, so the object itself holds no tensors.
    ``metrics`` are detached: ``loss``, ``kd_loss``, ``ce_loss``, ``kl_loss_scale`` plus the
    distillation term's own metrics.
    """

    def __init__(self, config: DistillationConfig) -> None:
        self.config = config

    def __call__(
        self,
        student_logits: torch.Tensor,
        data: Mapping[str, Any],
        teacher_logits: Optional[torch.Tensor] = None,
        *,
        tp_group: Group = None,
        vocab_start_index: Optional[int] = None,
        vocab_end_index: Optional[int] = None,
        dp_group: Group = None,
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        cfg = self.config
        if teacher_logits is None:
            if IPC_KEY not in data:
                raise KeyError(
                    f"CrossTokenizerDistillationLoss: pass teacher_logits or put {IPC_KEY!r} in data"
                )
            teacher_logits = rebuild_teacher_full_logits_from_ipc(data)
        alignment = alignment_from_flat_batch(data)
        sample_mask = data.get("sample_mask")
        shard = {
            "tp_group": tp_group,
            "vocab_start_index": vocab_start_index,
            "vocab_end_index": vocab_end_index,
        }
        device = student_logits.device
        if cfg.gold_loss:
            exact_map = build_exact_token_map(
                cfg.projection_matrix_path,
                device,
                xtoken_loss=cfg.xtoken_loss,
                teacher_vocab_size=cfg.teacher_vocab_size,
            )
            kd, metrics = gold_loss(
                student_logits,
                teacher_logits,
                alignment,
                exact_map,
                teacher_vocab_size=cfg.teacher_vocab_size,
                temperature=cfg.temperature,
                reverse_kl=cfg.reverse_kl,
                uncommon_topk=cfg.uncommon_topk,
                sample_mask=sample_mask,
                dp_group=dp_group,
                **shard,
            )
        else:
            projection = get_sparse_projection_matrix(
                cfg.projection_matrix_path,
                device,
                student_vocab_size=cfg.student_vocab_size,
                teacher_vocab_size=cfg.teacher_vocab_size,
            )
            kd, metrics = projection_kl_loss(
                student_logits,
                teacher_logits,
                alignment,
                projection,
                vocab_topk=cfg.vocab_topk,
                temperature=cfg.temperature,
                reverse_kl=cfg.reverse_kl,
                exact_token_match_only=cfg.exact_token_match_only,
                sample_mask=sample_mask,
                dp_group=dp_group,
                **shard,
            )
        ce = student_cross_entropy(
            student_logits,
            data["input_ids"],
            data.get("token_mask"),
            sample_mask=sample_mask,
            dp_group=dp_group,
            **shard,
        )
        loss, scale = combine_with_cross_entropy(
            kd,
            ce,
            kl_loss_weight=cfg.kl_loss_weight,
            ce_loss_scale=cfg.ce_loss_scale,
            dynamic_loss_scaling=cfg.dynamic_loss_scaling,
        )
        metrics = {
            **metrics,
            "loss": loss.detach(),
            "kd_loss": kd.detach(),
            "ce_loss": ce.detach(),
            "kl_loss_scale": scale.detach(),
        }
        return loss, metrics
