"""Fp32SparseMM against a dense fp64 matmul, including under bf16 autocast in forward and backward."""

from __future__ import annotations

import pytest
import torch

from shardkit.distill import Fp32SparseMM


def _matrix(v_s=7, v_t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(v_s, v_t, generator=g) * (torch.rand(v_s, v_t, generator=g) < 0.4)
    return dense.to_sparse().coalesce(), dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_forward_backward_match_dense(dtype):
    sparse, dense_m = _matrix()
    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    before = x.detach().clone()
    out = Fp32SparseMM.apply(sparse, x)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ref_x = x.detach().double().requires_grad_()
    ref = dense_m.double().t() @ ref_x
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    w = torch.randn(5, 3, dtype=torch.float64)
    (out.double() * w).sum().backward()
    (ref * w).sum().backward()
    assert x.grad.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=tol, atol=tol)
    assert torch.equal(x.detach(), before)


def test_bf16_autocast_forward_and_backward_stay_fp32():
    sparse, dense_m = _matrix(seed=3)
    lin = torch.nn.Linear(4, 3)
    inp = torch.randn(7, 4)
    seen = {}

    def hook(grad):
        seen["grad_dtype"] = grad.dtype
        return grad

    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(inp)  # bf16 under autocast
        assert h.dtype == torch.bfloat16
        h.register_hook(hook)
        out = Fp32SparseMM.apply(sparse, h)
        assert out.dtype == torch.float32
        loss = (out * out).sum()
        loss.backward()  # backward inside the autocast region too
    ref_h = h.detach().float().requires_grad_()
    ref = dense_m.t() @ ref_h
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    (ref * ref).sum().backward()
    # the gradient reaching the bf16 activation is the fp32 result cast once to bf16
    assert seen["grad_dtype"] == torch.bfloat16
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()


def test_no_gradient_for_the_matrix_and_bad_inputs():
    sparse, _ = _matrix()
    x = torch.randn(7, 2, requires_grad=True)
    Fp32SparseMM.apply(sparse.requires_grad_(), x).sum().backward()
    assert sparse.grad is None
    with pytest.raises(ValueError, match="rows"):
        Fp32SparseMM.apply(sparse, torch.randn(6, 2))
    with pytest.raises(TypeError, match="sparse COO"):
        Fp32SparseMM.apply(sparse.to_dense(), x)
