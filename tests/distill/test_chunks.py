"""chunk_average_log_probs / valid_chunk_mask / dp_all_reduce_sum against plain loops."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.distill import chunk_average_log_probs, dp_all_reduce_sum, valid_chunk_mask
from shardkit.distributed import set_validation
from shardkit.testing import run_world


def _reference(log_probs, chunk_id, max_chunks):
    b, _, v = log_probs.shape
    means = torch.zeros(b, max_chunks, v, dtype=torch.float64)
    sizes = torch.zeros(b, max_chunks)
    for i in range(b):
        for c in range(max_chunks):
            rows = log_probs[i][chunk_id[i] == c].double()
            sizes[i, c] = rows.size(0)
            if rows.size(0):
                means[i, c] = rows.mean(0)
    return means, sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_loop_reference_with_sentinels_and_empty_chunks(dtype):
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 11, 6, generator=g), -1).to(dtype).requires_grad_()
    cid = torch.randint(-1, 4, (3, 11), generator=g)
    cid[1] = -1  # a sample in no chunk at all
    max_chunks = 6  # chunks 4 and 5 are empty everywhere
    before_lp, before_cid = lp.detach().clone(), cid.clone()
    means, sizes = chunk_average_log_probs(lp, cid, max_chunks)
    ref_lp = lp.detach().double().requires_grad_()
    ref_means, ref_sizes = _reference(ref_lp, cid, max_chunks)
    assert means.shape == (3, 6, 6) and sizes.shape == (3, 6) and sizes.dtype == torch.float32
    assert torch.isfinite(means).all()
    assert torch.all(means[:, 4:] == 0) and torch.all(means[1] == 0)
    torch.testing.assert_close(sizes, ref_sizes)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(means.double(), ref_means, rtol=tol, atol=tol)
    w = torch.randn(3, 6, 6, dtype=torch.float64, generator=g)
    (means.double() * w).sum().backward()
    ref_grad = torch.zeros_like(ref_lp)
    for i in range(3):
        for t in range(11):
            c = int(cid[i, t])
            if c >= 0:
                ref_grad[i, t] = w[i, c] / ref_sizes[i, c]
    torch.testing.assert_close(lp.grad.double(), ref_grad, rtol=tol, atol=tol)
    assert torch.equal(lp.detach(), before_lp) and torch.equal(cid, before_cid)


def test_out_of_range_ids_and_shapes():
    lp = torch.zeros(1, 3, 2)
    with pytest.raises(ValueError, match=r"\[-1, 2\)"):
        chunk_average_log_probs(lp, torch.tensor([[0, 2, -1]]), 2)
    with pytest.raises(ValueError, match=r"\[-1, 2\)"):
        chunk_average_log_probs(lp, torch.tensor([[0, -2, -1]]), 2)
    with pytest.raises(ValueError, match="does not match"):
        chunk_average_log_probs(lp, torch.tensor([[0, 1]]), 2)
    with pytest.raises(TypeError, match="integer"):
        chunk_average_log_probs(lp, torch.zeros(1, 3), 2)
    set_validation(False)
    try:  # unchecked: no host sync, the caller vouches for the ids
        means, _ = chunk_average_log_probs(lp, torch.tensor([[0, 1, -1]]), 2)
        assert means.shape == (1, 2, 2)
    finally:
        set_validation(True)


def test_valid_chunk_mask():
    s = torch.tensor([[1.0, 0.0, 2.0, 3.0]])
    t = torch.tensor([[2.0, 1.0, 0.0, 1.0]])
    pv = torch.tensor([[True, True, True, False]])
    assert valid_chunk_mask(s, t, pv).tolist() == [[True, False, False, False]]
    with pytest.raises(ValueError, match="shapes differ"):
        valid_chunk_mask(s, t[:, :3], pv)


def test_dp_all_reduce_sum_single_process():
    local = torch.tensor(5, dtype=torch.int64)
    out = dp_all_reduce_sum(local)
    assert out.dtype == torch.float32 and out.item() == 5.0 and out.dim() == 0
    out += 1
    assert local.item() == 5


def _sum_counts():
    rank = dist.get_rank()
    local = torch.tensor(rank + 2)
    out = dp_all_reduce_sum(local)
    assert local.item() == rank + 2
    return out.item(), out.dtype


def test_dp_all_reduce_sum_two_ranks():
    assert run_world(_sum_counts, 2) == [(5.0, torch.float32)] * 2
