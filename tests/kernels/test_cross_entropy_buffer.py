"""The native CE gradient's buffer allocated and mapped in the forward (``SHARDKIT_CE_GRAD_BUFFER``).

With the default ("forward"), ``vocab_parallel_cross_entropy``'s forward allocates the logits'
gradient buffer and maps its pages (``ce_map_pages``) when a gradient will be wanted; the backward
writes the gradient into that very buffer. The gradient must be bitwise the one of a buffer allocated
in the backward ("backward"), and no buffer may be made for a call that wants no gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.kernels import cross_entropy as kce
from shardkit.kernels import kernel_backend, native_ops
from shardkit.losses import cross_entropy as ce
from shardkit.losses import vocab_parallel_cross_entropy

pytestmark = [
    pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a default group"),
]
needs_native = pytest.mark.skipif(native_ops() is None, reason="the native kernels do not build here")

T, V = 300, 3001  # 3.6 MB of fp32: rows start at every offset within a page
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def test_buffer_timing_from_the_environment():
    assert kce.requested_buffer_timing({}) == "forward"
    assert kce.requested_buffer_timing({kce.BUFFER_ENV: " "}) == "forward"
    assert kce.requested_buffer_timing({kce.BUFFER_ENV: " Backward "}) == "backward"
    assert kce.requested_buffer_timing({kce.BUFFER_ENV: "forward"}) == "forward"
    with pytest.raises(ValueError, match=f"{kce.BUFFER_ENV}='early'"):
        kce.requested_buffer_timing({kce.BUFFER_ENV: "early"})


@pytest.fixture
def buffers(monkeypatch):
    """Every buffer forward_gradient_buffer returns (None included), in call order."""
    made = []
    real = ce.forward_gradient_buffer

    def spy(ctx, logits, opts):
        buffer = real(ctx, logits, opts)
        made.append(buffer)
        return buffer

    monkeypatch.setattr(ce, "forward_gradient_buffer", spy)
    return made


def _inputs(dtype):
    gen = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(T, V, generator=gen)).to(dtype)
    t = torch.randint(0, V - 11, (T,), generator=gen)  # within a padded vocabulary of V - 11 too
    t[::7] = -100
    return x, t


def _gradient(x, t, **kwargs):
    leaf = x.clone().requires_grad_()
    with kernel_backend("native"):
        out = vocab_parallel_cross_entropy(leaf, t, reduction="mean", **kwargs)
        (out * 1.3).backward()
    return leaf.grad


@needs_native
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(
    "opts", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "temperature": 0.8, "vocab_size": 2990}]
)
def test_forward_buffer_becomes_the_gradient(buffers, monkeypatch, dtype, opts):
    x, t = _inputs(dtype)
    monkeypatch.setenv(kce.BUFFER_ENV, "backward")
    expected = _gradient(x, t, **opts)
    assert buffers == [None]
    monkeypatch.setenv(kce.BUFFER_ENV, "forward")
    grad = _gradient(x, t, **opts)
    assert len(buffers) == 2 and buffers[1] is not None
    assert grad.data_ptr() == buffers[1].data_ptr()
    assert grad.dtype == dtype and grad.shape == x.shape
    assert torch.equal(grad, expected)


@needs_native
def test_no_buffer_when_no_gradient_is_wanted(buffers):
    x, t = _inputs(torch.float32)
    with kernel_backend("native"):
        vocab_parallel_cross_entropy(x, t)  # no requires_grad: autograd is not involved at all
        with torch.no_grad():
            vocab_parallel_cross_entropy(x.clone().requires_grad_(), t)
    assert buffers == []
    # called through the Function directly (not through apply_cross_entropy): nothing known, no buffer
    local, target, opts = ce.prepare_cross_entropy("test", x.clone().requires_grad_(), t, None, None, None)
    with torch.no_grad():
        ce.VocabParallelCrossEntropy.apply(local, target, opts)
    # in-place backward writes into the logits; the torch path has no native kernel
    _gradient(x, t, inplace_backward=True)
    leaf = x.clone().requires_grad_()
    with kernel_backend("torch"):
        vocab_parallel_cross_entropy(leaf, t, reduction="sum").backward()
    assert buffers == [None, None, None]


@needs_native
def test_retained_graph_backward_twice_gets_two_buffers(buffers):
    x, t = _inputs(torch.float32)
    leaf = x.clone().requires_grad_()
    with kernel_backend("native"):
        loss = vocab_parallel_cross_entropy(leaf, t, reduction="sum")
        loss.backward(retain_graph=True)
        first, leaf.grad = leaf.grad, None
        kept = first.clone()
        loss.backward()
    assert first.data_ptr() == buffers[0].data_ptr() and leaf.grad.data_ptr() != first.data_ptr()
    assert torch.equal(first, kept) and torch.equal(leaf.grad, kept)


@pytest.fixture
def ops():
    ops = native_ops()
    before = ops.ce_fault_mode(-1)
    yield ops
    ops.ce_fault_mode(before)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_map_pages_then_premapped_gradient_matches(ops, dtype):
    x, t = _inputs(dtype)
    real = V - 11
    lse = torch.logsumexp(x[:, :real].float(), 1).contiguous()
    coef_p = torch.rand(T, generator=torch.Generator().manual_seed(1)).contiguous()
    index = t.clamp(min=0)
    minus_target = torch.where(index < real, -coef_p, torch.zeros_like(coef_p)).contiguous()
    active = t >= 0
    args = (lse, coef_p, minus_target, None, index, active, real, 1.0)
    expected = ops.ce_gradient(x, torch.full_like(x, float("nan")), *args).clone()
    for mode in (0, 1):
        ops.ce_fault_mode(mode)
        buffer = torch.empty_like(x)
        assert ops.ce_map_pages(buffer).data_ptr() == buffer.data_ptr()
        assert torch.equal(ops.ce_gradient(x, buffer, *args, premapped=True), expected), f"mode {mode}"
    stale = torch.full_like(x, float("nan"))  # premapped promises mapped pages, not zeroed ones
    assert torch.equal(ops.ce_gradient(x, stale, *args, premapped=True), expected)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.ce_map_pages(torch.empty(8, 8)[:, ::2])
    ops.ce_map_pages(torch.empty(0, 5))
