"""The distillation losses against loop references; vocab-parallel (tp=2) equals tp=1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.distill import AlignmentBatch, build_exact_token_map, clear_projection_caches
from shardkit.distill.losses import (
    combine_with_cross_entropy,
    gold_loss,
    projection_kl_loss,
    student_cross_entropy,
)
from shardkit.testing import run_world
from tests.distill.reference import reference_gold, reference_projection_kl

B, TS, TT, VS, VT, C = 3, 9, 8, 10, 12, 6


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    s_logits = torch.randn(B, TS, VS, generator=g) * 2
    t_logits = torch.randn(B, TT, VT + 2, generator=g) * 2  # 2 padded teacher columns
    s_cid = torch.randint(-1, C, (B, TS), generator=g).sort(dim=1).values
    t_cid = torch.randint(-1, C, (B, TT), generator=g).sort(dim=1).values
    pair_valid = torch.ones(B, C, dtype=torch.bool)
    pair_valid[0, C - 1] = False  # padding pair
    pair_correct = torch.rand(B, C, generator=g) < 0.7
    m = torch.rand(VS, VT, generator=g) * (torch.rand(VS, VT, generator=g) < 0.35)
    m[0] = 0  # a student token projecting nowhere
    sample_mask = torch.tensor([1.0, 1.0, 0.0])
    alignment = AlignmentBatch(
        pair_valid=pair_valid,
        pair_is_correct=pair_correct,
        student_exact_partition_mask=torch.zeros(B, TS, dtype=torch.bool),
        teacher_exact_partition_mask=torch.zeros(B, TT, dtype=torch.bool),
        student_chunk_id=s_cid,
        teacher_chunk_id=t_cid,
        num_chunks=pair_valid.sum(1),
    )
    return s_logits, t_logits, alignment, m, sample_mask


@pytest.mark.parametrize("reverse,exact_only,k,tau", [(False, False, 5, 1.0), (True, True, 100, 2.0)])
def test_projection_kl_matches_reference(reverse, exact_only, k, tau):
    s_logits, t_logits, a, m, sm = _case()
    x = s_logits.clone().requires_grad_()
    loss, metrics = projection_kl_loss(
        x,
        t_logits,
        a,
        m.to_sparse().coalesce(),
        vocab_topk=k,
        temperature=tau,
        reverse_kl=reverse,
        exact_token_match_only=exact_only,
        sample_mask=sm,
    )
    ref_x = s_logits.double().requires_grad_()
    ref, n = reference_projection_kl(
        ref_x,
        t_logits,
        a.student_chunk_id,
        a.teacher_chunk_id,
        a.pair_valid,
        a.pair_is_correct,
        m,
        k=k,
        tau=tau,
        reverse=reverse,
        exact_only=exact_only,
        sample_mask=sm.bool(),
    )
    assert n > 0 and int(metrics["num_valid_chunks"]) == n == int(metrics["global_valid_chunks"])
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-4, atol=1e-5)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-3, atol=1e-5)
    assert torch.all(x.grad[2] == 0)  # the masked sample


@pytest.mark.parametrize("reverse,xtoken,topk,tau", [(False, False, 8192, 1.0), (True, True, 3, 1.5)])
def test_gold_loss_matches_reference(tmp_path, reverse, xtoken, topk, tau):
    clear_projection_caches()
    s_logits, t_logits, a, _, sm = _case(1)
    indices = torch.tensor([[i % VT, -1] if i % 3 else [(i + 1) % VT, i % VT] for i in range(VS)])
    likelihoods = torch.tensor([[1.0, 0.0] if i % 3 else [0.7, 0.3] for i in range(VS)])
    indices[4] = torch.tensor([VT + 5, -1])  # outside the teacher vocabulary
    path = tmp_path / "p.pt"
    torch.save({"indices": indices, "likelihoods": likelihoods}, path)
    emap = build_exact_token_map(path, "cpu", xtoken_loss=xtoken, teacher_vocab_size=VT)
    assert emap["common_student"].numel() > 0 and emap["uncommon_student"].numel() > 0
    x = s_logits.clone().requires_grad_()
    before = s_logits.clone()
    loss, metrics = gold_loss(
        x,
        t_logits,
        a,
        emap,
        teacher_vocab_size=VT,
        temperature=tau,
        reverse_kl=reverse,
        uncommon_topk=topk,
        sample_mask=sm,
    )
    ref_x = s_logits.double().requires_grad_()
    ref, kl, l1, n = reference_gold(
        ref_x,
        t_logits,
        a.student_chunk_id,
        a.teacher_chunk_id,
        a.pair_valid,
        emap,
        v_t=VT,
        tau=tau,
        reverse=reverse,
        topk=topk,
        sample_mask=sm.bool(),
    )
    assert int(metrics["num_valid_chunks"]) == n
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(metrics["kl_common"].double(), kl.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(metrics["l1_uncommon"].double(), l1.detach(), rtol=1e-4, atol=1e-5)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-3, atol=1e-5)
    assert torch.equal(x.detach(), before)
    clear_projection_caches()


def test_no_valid_chunk_gives_zero_and_zero_gradient():
    s_logits, t_logits, a, m, _ = _case()
    a.pair_valid = torch.zeros_like(a.pair_valid)
    x = s_logits.clone().requires_grad_()
    loss, metrics = projection_kl_loss(x, t_logits, a, m.to_sparse(), vocab_topk=4)
    assert loss.item() == 0.0 and int(metrics["global_valid_chunks"]) == 0
    loss.backward()
    assert torch.all(x.grad == 0)


def test_cross_entropy_and_combination():
    s_logits, _, _, _, sm = _case()
    ids = torch.randint(0, VS, (B, TS), generator=torch.Generator().manual_seed(5))
    token_mask = torch.ones(B, TS, dtype=torch.bool)
    token_mask[0, -3:] = False
    x = s_logits.clone().requires_grad_()
    ce = student_cross_entropy(x, ids, token_mask, sample_mask=sm)
    keep = token_mask[:, 1:] & sm.bool().unsqueeze(1)
    ref = F.cross_entropy(s_logits[:, :-1][keep].double(), ids[:, 1:][keep])
    torch.testing.assert_close(ce.double(), ref, rtol=1e-5, atol=1e-6)
    ce.backward(retain_graph=True)
    assert torch.all(x.grad[:, -1] == 0) and torch.all(x.grad[2] == 0)  # no target / masked sample
    x.grad = None
    kd = (x**2).mean()
    loss, scale = combine_with_cross_entropy(kd, ce, kl_loss_weight=0.5, ce_loss_scale=2.0)
    torch.testing.assert_close(loss, 0.5 * kd + 2.0 * ce)
    assert scale.item() == 1.0
    loss, scale = combine_with_cross_entropy(kd, ce, dynamic_loss_scaling=True)
    torch.testing.assert_close(scale, ce.detach() / kd.detach())
    torch.testing.assert_close(loss, 2 * ce)  # the rescaled kd matches ce in magnitude
    loss.backward()
    # the scale is a constant: the gradient is scale * d(kd) + d(ce)
    y = s_logits.clone().requires_grad_()
    (scale * (y**2).mean() + student_cross_entropy(y, ids, token_mask, sample_mask=sm)).backward()
    torch.testing.assert_close(x.grad, y.grad)
    zero, scale = combine_with_cross_entropy(torch.zeros(()), ce.detach(), dynamic_loss_scaling=True)
    assert scale.item() == 1.0


def test_shape_errors():
    s_logits, t_logits, a, m, _ = _case()
    with pytest.raises(ValueError, match="student_chunk_id"):
        projection_kl_loss(s_logits[:, :5], t_logits, a, m.to_sparse(), vocab_topk=3)
    with pytest.raises(ValueError, match="student rows"):
        projection_kl_loss(s_logits, t_logits, a, m[:5].to_sparse(), vocab_topk=3)
    with pytest.raises(ValueError, match="sample_mask"):
        projection_kl_loss(s_logits, t_logits, a, m.to_sparse(), vocab_topk=3, sample_mask=torch.ones(2))


def _tp_losses(path):
    """Each rank holds a vocabulary slice of the student logits; uneven slices (6 + 4)."""
    rank = dist.get_rank()
    start, end = (0, 6) if rank == 0 else (6, VS)
    s_logits, t_logits, a, m, sm = _case(2)
    out = {}
    for name in ("pkl", "gold", "ce"):
        x = s_logits[..., start:end].clone().requires_grad_()
        kw = {"tp_group": None, "vocab_start_index": start, "vocab_end_index": end}
        if name == "pkl":
            loss, _ = projection_kl_loss(
                x, t_logits, a, m.to_sparse().coalesce(), vocab_topk=6, sample_mask=sm, **kw
            )
        elif name == "gold":
            emap = build_exact_token_map(path, "cpu", xtoken_loss=True, teacher_vocab_size=VT)
            loss, _ = gold_loss(
                x, t_logits, a, emap, teacher_vocab_size=VT, uncommon_topk=5, sample_mask=sm, **kw
            )
        else:
            ids = torch.randint(0, VS, (B, TS), generator=torch.Generator().manual_seed(5))
            loss = student_cross_entropy(x, ids, sample_mask=sm, **kw)
        loss.backward()
        out[name] = (loss.item(), x.grad)
    return out


def _single_losses(path):
    s_logits, t_logits, a, m, sm = _case(2)
    out = {}
    for name in ("pkl", "gold", "ce"):
        x = s_logits.clone().requires_grad_()
        if name == "pkl":
            loss, _ = projection_kl_loss(
                x, t_logits, a, m.to_sparse().coalesce(), vocab_topk=6, sample_mask=sm
            )
        elif name == "gold":
            emap = build_exact_token_map(path, "cpu", xtoken_loss=True, teacher_vocab_size=VT)
            loss, _ = gold_loss(x, t_logits, a, emap, teacher_vocab_size=VT, uncommon_topk=5, sample_mask=sm)
        else:
            ids = torch.randint(0, VS, (B, TS), generator=torch.Generator().manual_seed(5))
            loss = student_cross_entropy(x, ids, sample_mask=sm)
        loss.backward()
        out[name] = (loss.item(), x.grad)
    return out


def test_vocab_parallel_student_equals_unsharded(tmp_path):
    clear_projection_caches()
    indices = torch.tensor([[i % VT, -1] if i % 2 else [(i + 3) % VT, i % VT] for i in range(VS)])
    likelihoods = torch.tensor([[1.0, 0.0] if i % 2 else [0.6, 0.4] for i in range(VS)])
    path = tmp_path / "p.pt"
    torch.save({"indices": indices, "likelihoods": likelihoods}, path)
    single = _single_losses(path)
    ranks = run_world(_tp_losses, 2, path)
    for name, (value, grad) in single.items():
        for rank, (start, end) in enumerate([(0, 6), (6, VS)]):
            got_value, got_grad = ranks[rank][name]
            assert got_value == pytest.approx(value, rel=1e-5, abs=1e-6), name
            torch.testing.assert_close(got_grad, grad[..., start:end], rtol=1e-4, atol=1e-6)
    clear_projection_caches()


def _dp_ranks_disagree_on_the_teacher_vocabulary():
    rank = dist.get_rank()
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # tp = 1 on every rank
    s_logits, t_logits, a, m, sm = _case(3)
    if rank == 1:
        t_logits, m = t_logits[..., : VT - 1], m[:, : VT - 1]  # one teacher column fewer
    with pytest.raises(ValueError, match="ranks disagree on the projection_kl_loss"):
        projection_kl_loss(
            s_logits,
            t_logits,
            a,
            m.to_sparse().coalesce(),
            vocab_topk=4,
            tp_group=own,
            dp_group=dist.group.WORLD,
        )
    return True


def test_dp_ranks_with_different_teacher_vocabularies_fail_on_every_rank():
    assert run_world(_dp_ranks_disagree_on_the_teacher_vocabulary, 2, timeout=60) == [True, True]
