"""Layer 1: cross-tokenizer distillation (see docs/distill.md).

Distill a teacher language model into a student whose tokenizer differs: align the two
tokenizations of a text into chunk pairs with equal texts, project student probabilities onto the
teacher vocabulary through a sparse matrix, and compare chunk-averaged distributions. Imports only
torch, ``shardkit.distributed`` and ``shardkit.losses`` (for a vocab-parallel student).
"""

from shardkit.distill.aligner import (
    AlignedBatch,
    ChunkPair,
    TokenAligner,
    align_offsets,
    alignment_batch_from_offsets,
    pack_alignment,
)
from shardkit.distill.alignment_batch import AlignmentBatch, alignment_from_flat_batch
from shardkit.distill.chunks import chunk_average_log_probs, valid_chunk_mask
from shardkit.distill.counts import dp_all_reduce_sum
from shardkit.distill.exact_map import build_exact_token_map
from shardkit.distill.ipc import TeacherLogitsBuffer, rebuild_teacher_full_logits_from_ipc
from shardkit.distill.loss_fn import CrossTokenizerDistillationLoss, DistillationConfig
from shardkit.distill.losses import (
    combine_with_cross_entropy,
    gold_loss,
    projection_kl_loss,
    student_cross_entropy,
)
from shardkit.distill.projection_builder import CoverageReport, Projection, build_projection, canonical_token
from shardkit.distill.projection_files import (
    clear_projection_caches,
    get_sparse_projection_matrix,
    get_topk_projection,
    parse_projection_file,
)
from shardkit.distill.sparse_mm import Fp32SparseMM

__all__ = [
    "AlignedBatch",
    "AlignmentBatch",
    "ChunkPair",
    "CoverageReport",
    "CrossTokenizerDistillationLoss",
    "DistillationConfig",
    "Fp32SparseMM",
    "Projection",
    "TeacherLogitsBuffer",
    "TokenAligner",
    "align_offsets",
    "alignment_batch_from_offsets",
    "alignment_from_flat_batch",
    "build_exact_token_map",
    "build_projection",
    "canonical_token",
    "chunk_average_log_probs",
    "clear_projection_caches",
    "combine_with_cross_entropy",
    "dp_all_reduce_sum",
    "get_sparse_projection_matrix",
    "get_topk_projection",
    "gold_loss",
    "pack_alignment",
    "parse_projection_file",
    "projection_kl_loss",
    "rebuild_teacher_full_logits_from_ipc",
    "student_cross_entropy",
    "valid_chunk_mask",
]
