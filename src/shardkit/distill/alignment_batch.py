"""``AlignmentBatch``: the dense-padded alignment tensors of a batch, and their flat transport keys."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping

import torch

FLAT_PREFIX = "alignment_"


@dataclass
class AlignmentBatch:
    """Alignment of a batch of texts tokenized by a student and a teacher tokenizer.

    Tensors are padded to the batch maximum (``C`` = max number of chunk pairs, at least 1).
    Chunk ids index *tokens* (position ``i`` holds the chunk of token ``i``); the losses apply the
    next-token shift themselves (see ``shardkit.distill.losses``).

    Attributes:
        pair_valid: ``[B, C]`` bool, False on padding pairs.
        pair_is_correct: ``[B, C]`` bool, True when both sides are non-empty and their texts are equal.
        student_exact_partition_mask: ``[B, T_s]`` bool, True at student tokens on a one-to-one
            pair with equal texts.
        teacher_exact_partition_mask: ``[B, T_t]`` bool, the teacher counterpart.
        student_chunk_id: ``[B, T_s]`` int64 in ``[-1, C)``, -1 for tokens in no chunk (padding,
            zero-width special tokens).
        teacher_chunk_id: ``[B, T_t]`` int64, the teacher counterpart.
        num_chunks: ``[B]`` int64, the number of chunk pairs of each sample.
    """

    pair_valid: torch.Tensor
    pair_is_correct: torch.Tensor
    student_exact_partition_mask: torch.Tensor
    teacher_exact_partition_mask: torch.Tensor
    student_chunk_id: torch.Tensor
    teacher_chunk_id: torch.Tensor
    num_chunks: torch.Tensor

    def to_flat_batch(self) -> Dict[str, torch.Tensor]:
        """The flat ``{"alignment_<field>": tensor}`` dict (the tensors themselves, not copies)."""
        return {FLAT_PREFIX + f.name: getattr(self, f.name) for f in fields(self)}


def alignment_from_flat_batch(data: Mapping[str, Any]) -> AlignmentBatch:
    """Rebuild an ``AlignmentBatch`` from the flat ``alignment_<field>`` keys of a data dict.

    The keys are derived from the dataclass's fields, so the transport cannot drift from the schema.
    Other keys are ignored; the tensors are taken as they are (no copy). Raises ``KeyError`` naming
    every missing key.
    """
    names = [f.name for f in fields(AlignmentBatch)]
    missing = [FLAT_PREFIX + n for n in names if FLAT_PREFIX + n not in data]
    if missing:
        raise KeyError(f"alignment_from_flat_batch: the data dict lacks {missing}")
    return AlignmentBatch(**{n: data[FLAT_PREFIX + n] for n in names})
