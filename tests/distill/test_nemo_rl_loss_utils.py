"""NeMo RL's current ``x_token.loss_utils`` additions (issue 28, item 3) against references:
unsharded teacher logits for the shard assembly, dense slicing for the projection, single-process
slicing / log-softmax for the group-taking names at cp / tp 1-2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardkit.losses
from shardkit.distill import TeacherLogitsBuffer
from shardkit.distill.nemo_rl_loss_utils import (
    LocalizedAlignment,
    _try_zero_copy_teacher_logits,
    assemble_teacher_logits_from_shards,
    collect_overlapping_teacher_shards,
    localize_alignment,
    slice_sparse_projection_cols,
    vocab_parallel_log_softmax,
)
from shardkit.testing import run_world

S, V, B = 8, 6, 2  # full teacher sequence, full teacher vocabulary, samples


def _teacher(seed=0):
    return torch.randn(B, S, V, generator=torch.Generator().manual_seed(seed))


def _shards(full, teacher_tp, teacher_cp):
    """Per sample, the teacher's shards: rank (cp c, tp t) holds rows [c*S/cp, ...) and columns
    [t*V/tp, ...) of every sample, stored in its own [N=2, B, T_max, V_max] slab (slot 1) whose
    padding holds NaN, so reading past ``actual_shape`` would show."""
    t_loc, v_loc = S // teacher_cp, V // teacher_tp
    per_sample = [[] for _ in range(B)]
    for c in range(teacher_cp):
        for t in range(teacher_tp):
            storage = torch.full((2, B, t_loc + 1, v_loc + 2), float("nan"))
            storage[1, :, :t_loc, :v_loc] = full[:, c * t_loc : (c + 1) * t_loc, t * v_loc : (t + 1) * v_loc]
            for b in range(B):
                per_sample[b].append(
                    {
                        "payload_ipc": storage,
                        "buf_idx": 1,
                        "sample_index_in_buf": b,
                        "actual_shape": (t_loc, v_loc),
                        "vocab_start_index": t * v_loc,
                        "vocab_end_index": (t + 1) * v_loc,
                        "global_seq_start": c * t_loc,
                        "full_seq_len": S,
                        "full_vocab_size": V,
                    }
                )
    return per_sample


@pytest.mark.parametrize("teacher_tp", [1, 2])
@pytest.mark.parametrize("teacher_cp", [1, 2, 4])
@pytest.mark.parametrize("student_cp", [1, 2, 4])
def test_assembly_equals_the_unsharded_window(teacher_tp, teacher_cp, student_cp):
    full = _teacher()
    per_sample = _shards(full, teacher_tp, teacher_cp)
    w = S // student_cp
    for r in range(student_cp):
        for b in range(B):
            out = assemble_teacher_logits_from_shards(per_sample[b], r, student_cp, "cpu")
            assert out.dtype == torch.float32 and out.shape == (w, V)
            torch.testing.assert_close(out, full[b, r * w : (r + 1) * w], rtol=0, atol=0)
            plans = collect_overlapping_teacher_shards(per_sample[b], r, student_cp, S)
            # only overlapping shards; destination rows and columns are covered exactly once
            cover = torch.zeros(w, V, dtype=torch.long)
            for _, src_seq, src_vocab, dest_seq, dest_vocab in plans:
                assert src_seq.stop - src_seq.start == dest_seq.stop - dest_seq.start > 0
                assert src_vocab.stop - src_vocab.start == dest_vocab.stop - dest_vocab.start
                cover[dest_seq, dest_vocab] += 1
            assert (cover == 1).all()
            assert len(plans) == teacher_tp * max(1, teacher_cp // student_cp)


def test_uncovered_positions_stay_zero_and_bad_input_is_named():
    full = _teacher()
    shards = _shards(full, 2, 2)[0]
    out = assemble_teacher_logits_from_shards(shards[1:], 0, 1, "cpu")  # rank (cp 0, tp 0) missing
    assert (out[:4, :3] == 0).all()
    torch.testing.assert_close(out[:, 3:], full[0, :, 3:], rtol=0, atol=0)
    torch.testing.assert_close(out[4:], full[0, 4:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="non-empty"):
        assemble_teacher_logits_from_shards([], 0, 1, "cpu")
    with pytest.raises(ValueError, match="not divisible"):
        assemble_teacher_logits_from_shards(shards, 0, 3, "cpu")
    with pytest.raises(ValueError, match="student_cp_rank"):
        collect_overlapping_teacher_shards(shards, 2, 2, S)
    bad = dict(shards[0], actual_shape=(4, 5))
    with pytest.raises(ValueError, match="does not match actual_shape"):
        collect_overlapping_teacher_shards([bad], 0, 1, S)
    bad = dict(shards[0], buf_idx=2)
    with pytest.raises(ValueError, match="outside its storage"):
        assemble_teacher_logits_from_shards([bad], 0, 1, "cpu")
    with pytest.raises(ValueError, match="disagree"):
        assemble_teacher_logits_from_shards([shards[0], dict(shards[1], full_seq_len=16)], 0, 1, "cpu")
    with pytest.raises(ValueError, match="compact"):
        collect_overlapping_teacher_shards([dict(shards[0], storage_shape=(4, 3))], 0, 1, S)
    # cp sizes that do not divide S: the windows are floor(r * S / cp) as in NeMo RL (the plan only)
    plans = collect_overlapping_teacher_shards(_shards(full, 1, 1)[0], 1, 3, S)
    assert [(p[1], p[3]) for p in plans] == [(slice(2, 5), slice(0, 3))]


@pytest.mark.parametrize("cp", [1, 2])
def test_zero_copy_view_when_one_full_vocabulary_shard_covers_the_window(cp):
    full = _teacher()
    w = S // cp
    for teacher_cp in (1, cp):
        per_sample = _shards(full, 1, teacher_cp)
        entries = [{"teacher_shards": shards} for shards in per_sample]
        for r in range(cp):
            view = _try_zero_copy_teacher_logits(entries, student_cp_rank=r, student_cp_size=cp, device="cpu")
            assert view is not None and view.shape == (B, w, V)
            torch.testing.assert_close(view, full[:, r * w : (r + 1) * w], rtol=0, atol=0)
            shard = [h for h in per_sample[0] if h["global_seq_start"] <= r * w][-1]
            assert view.untyped_storage().data_ptr() == shard["payload_ipc"].untyped_storage().data_ptr()
            # and it is the copy path's result
            for b in range(B):
                torch.testing.assert_close(
                    view[b], assemble_teacher_logits_from_shards(per_sample[b], r, cp, "cpu"), rtol=0, atol=0
                )


def test_zero_copy_declines_when_a_copy_is_needed():
    full = _teacher()
    kw = dict(student_cp_rank=0, student_cp_size=1, device="cpu")
    vocab_sharded = [{"teacher_shards": s} for s in _shards(full, 2, 1)]
    assert _try_zero_copy_teacher_logits(vocab_sharded, **kw) is None
    seq_sharded = [{"teacher_shards": s} for s in _shards(full, 1, 2)]
    assert _try_zero_copy_teacher_logits(seq_sharded, **kw) is None  # two shards cover rank 0's window
    entries = [{"teacher_shards": s} for s in _shards(full, 1, 1)]
    swapped = [entries[1], entries[0]]  # rows 1, 0 of the slot: not a slab starting at row 0
    assert _try_zero_copy_teacher_logits(swapped, **kw) is None
    other = [
        {"teacher_shards": [dict(h, payload_ipc=h["payload_ipc"].clone())]}
        for h in [entries[1]["teacher_shards"][0]]
    ]
    assert _try_zero_copy_teacher_logits([entries[0], other[0]], **kw) is None
    assert _try_zero_copy_teacher_logits([], **kw) is None


def test_shardkit_ipc_buffer_as_payload_is_viewed_not_copied():
    full = _teacher()
    buf = TeacherLogitsBuffer((B, S, V), torch.float32, "cpu")
    try:
        buf.update(full)
        handle = buf.handle()
        entries = [
            {
                "teacher_shards": [
                    {
                        "payload_ipc": handle,
                        "buf_idx": 0,
                        "sample_index_in_buf": b,
                        "actual_shape": (S, V),
                        "vocab_start_index": 0,
                        "vocab_end_index": V,
                        "global_seq_start": 0,
                        "full_seq_len": S,
                        "full_vocab_size": V,
                    }
                ]
            }
            for b in range(B)
        ]
        view = _try_zero_copy_teacher_logits(entries, student_cp_rank=1, student_cp_size=2, device="cpu")
        torch.testing.assert_close(view, full[:, 4:], rtol=0, atol=0)
        buf.update(full + 1)  # the producer's next step is visible through the view
        torch.testing.assert_close(view, full[:, 4:] + 1, rtol=0, atol=0)
        out = assemble_teacher_logits_from_shards(entries[1]["teacher_shards"], 0, 2, "cpu")
        torch.testing.assert_close(out, full[1, :4] + 1, rtol=0, atol=0)
    finally:
        buf.close()


def test_slice_sparse_projection_cols_equals_dense_columns():
    g = torch.Generator().manual_seed(3)
    dense = torch.rand(7, 9, generator=g) * (torch.rand(7, 9, generator=g) < 0.4)
    sparse = dense.to_sparse_coo()
    for cols in ([0, 2, 3, 8], [8, 1, 1, 4], [], [5]):
        idx = torch.tensor(cols, dtype=torch.long)
        out = slice_sparse_projection_cols(sparse, idx)
        assert out.layout == torch.sparse_coo and out.is_coalesced() and out.shape == (7, len(cols))
        torch.testing.assert_close(out.to_dense(), dense[:, idx], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"lie in \[0, 9\)"):
        slice_sparse_projection_cols(sparse, torch.tensor([9]))
    with pytest.raises(ValueError, match="1-D integers"):
        slice_sparse_projection_cols(sparse, torch.tensor([1.0]))
    with pytest.raises(TypeError, match="sparse COO"):
        slice_sparse_projection_cols(dense, torch.tensor([1]))


def _alignment_data(seed=5):
    g = torch.Generator().manual_seed(seed)
    return {
        "sample_mask": torch.tensor([1.0, 0.0]),
        "alignment_student_chunk_id": torch.randint(-1, 4, (2, 10), generator=g),
        "alignment_teacher_chunk_id": torch.randint(-1, 4, (2, S), generator=g),
        "alignment_pair_valid": torch.rand(2, 4, generator=g) < 0.5,
        "alignment_pair_is_correct": torch.rand(2, 4, generator=g) < 0.5,
    }


def _check_group_names():
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    data = _alignment_data()
    out = localize_alignment(data, teacher_seq_len=S // world, cp_group=group)
    assert isinstance(out, LocalizedAlignment)
    w = S // world
    assert torch.equal(out.teacher_chunk_id, data["alignment_teacher_chunk_id"][:, rank * w : (rank + 1) * w])
    assert out.student_chunk_id is data["alignment_student_chunk_id"]  # left as it is
    assert out.pair_valid is data["alignment_pair_valid"] and out.sample_mask is data["sample_mask"]
    # vocab_parallel_log_softmax over a tp group: the rank's columns of the full log-softmax
    x_full = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    g_full = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    lo, hi = rank * 12 // world, (rank + 1) * 12 // world
    x = x_full[..., lo:hi].clone().requires_grad_()
    out = vocab_parallel_log_softmax(x, 0.5, tp_group=group)
    ref_x = x_full.clone().requires_grad_()
    ref = torch.log_softmax(ref_x / 0.5, -1)
    torch.testing.assert_close(out.double(), ref[..., lo:hi].detach(), rtol=1e-5, atol=1e-5)
    (out.double() * g_full[..., lo:hi]).sum().backward()
    (ref * g_full).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad[..., lo:hi], rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_group_taking_names_match_single_process_references(world_size):
    assert all(run_world(_check_group_names, world_size))


def test_localize_alignment_without_a_group_and_bad_input():
    data = _alignment_data()
    out = localize_alignment(data, teacher_seq_len=5, alignment_prefix="alignment_")
    assert torch.equal(out.teacher_chunk_id, data["alignment_teacher_chunk_id"][:, :5])
    prefixed = {k.replace("alignment_", "alignment_1_"): v for k, v in data.items()}
    out = localize_alignment(prefixed, teacher_seq_len=S, alignment_prefix="alignment_1_")
    assert torch.equal(out.teacher_chunk_id, data["alignment_teacher_chunk_id"])
    with pytest.raises(KeyError, match="alignment_1_pair_valid"):
        localize_alignment(
            {k: v for k, v in prefixed.items() if k != "alignment_1_pair_valid"},
            teacher_seq_len=S,
            alignment_prefix="alignment_1_",
        )
    with pytest.raises(ValueError, match="beyond"):
        localize_alignment(data, teacher_seq_len=S + 1)


def test_vocab_parallel_log_softmax_is_the_losses_function():
    assert vocab_parallel_log_softmax is shardkit.losses.vocab_parallel_log_softmax


# --- the cases of NeMo RL's own loss_utils tests (written here from their descriptions) -----------


def _geometry(vocab_start, vocab_end, seq_start, seq_len):
    return {
        "vocab_start_index": vocab_start,
        "vocab_end_index": vocab_end,
        "global_seq_start": seq_start,
        "actual_shape": (seq_len, vocab_end - vocab_start),
    }


def test_plans_for_one_shard_cp_ranks_and_tp_ranks():
    (plan,) = collect_overlapping_teacher_shards([_geometry(0, 5, 0, 4)], 0, 1, 4)
    assert plan[1:] == (slice(0, 4), slice(0, 5), slice(0, 4), slice(0, 5))
    s0, s1 = _geometry(0, 5, 0, 4), _geometry(0, 5, 4, 4)
    plans = collect_overlapping_teacher_shards([s0, s1], 1, 2, 8)
    assert len(plans) == 1 and plans[0][0] is s1 and plans[0][3] == slice(0, 4)
    plans = collect_overlapping_teacher_shards([_geometry(0, 4, 0, 2), _geometry(4, 8, 0, 2)], 0, 1, 2)
    assert [p[4] for p in plans] == [slice(0, 4), slice(4, 8)]


def _entry(storage, b, vocab_end=5):
    return {
        "teacher_shards": [
            dict(
                _geometry(0, vocab_end, 0, 4),
                payload_ipc=storage,
                buf_idx=0,
                sample_index_in_buf=b,
                full_seq_len=4,
                full_vocab_size=5,
            )
        ]
    }


def test_zero_copy_view_points_into_the_storage_at_the_cp_offset():
    storage = torch.arange(2 * 4 * 5, dtype=torch.float32).reshape(1, 2, 4, 5)
    entries = [_entry(storage, 0), _entry(storage, 1)]
    out = _try_zero_copy_teacher_logits(entries, student_cp_rank=0, student_cp_size=1, device="cpu")
    assert out.data_ptr() == storage.data_ptr() and torch.equal(out, storage[0, :2])
    out = _try_zero_copy_teacher_logits(entries, student_cp_rank=1, student_cp_size=2, device="cpu")
    expected = storage[0, :2, 2:4, :]
    assert out.data_ptr() == expected.data_ptr() and torch.equal(out, expected)
    kw = dict(student_cp_rank=0, student_cp_size=1, device="cpu")
    assert _try_zero_copy_teacher_logits([_entry(storage, 0, vocab_end=3)], **kw) is None  # vocab-sharded
    assert _try_zero_copy_teacher_logits([_entry(storage, 0), _entry(storage, 2)], **kw) is None  # rows 0, 2
