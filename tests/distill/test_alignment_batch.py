"""AlignmentBatch and its flat transport keys."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from shardkit.distill import AlignmentBatch, alignment_from_flat_batch


def _batch():
    return AlignmentBatch(
        pair_valid=torch.tensor([[True, False]]),
        pair_is_correct=torch.tensor([[True, False]]),
        student_exact_partition_mask=torch.tensor([[True, False, False]]),
        teacher_exact_partition_mask=torch.tensor([[True, False]]),
        student_chunk_id=torch.tensor([[0, 1, -1]]),
        teacher_chunk_id=torch.tensor([[0, 1]]),
        num_chunks=torch.tensor([2]),
    )


def test_round_trip_without_copies():
    batch = _batch()
    flat = batch.to_flat_batch()
    assert sorted(flat) == sorted(f"alignment_{f.name}" for f in fields(AlignmentBatch))
    data = {**flat, "input_ids": torch.zeros(1, 3), "unrelated": 1}
    back = alignment_from_flat_batch(data)
    for f in fields(AlignmentBatch):
        assert getattr(back, f.name) is getattr(batch, f.name)


def test_missing_keys_are_named():
    flat = _batch().to_flat_batch()
    del flat["alignment_num_chunks"], flat["alignment_pair_valid"]
    with pytest.raises(KeyError, match="alignment_pair_valid.*alignment_num_chunks"):
        alignment_from_flat_batch(flat)
