"""The native CPU cross-entropy kernels (csrc/cross_entropy.cpp) against the pure-torch blocks and torch.

Each case runs ``vocab_parallel_cross_entropy`` (one process, no group) under
``kernel_backend("native")`` and ``kernel_backend("torch")`` on the same inputs, and both against
``F.cross_entropy`` in fp64. The L1d size is shrunk so that the statistics' row chunks (L1d-sized)
split every row into several chunks and the chunk merge is exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.kernels import kernel_backend, native_ops
from shardkit.kernels.cpu_cache import CacheSizes
from shardkit.losses import ce_kernel_calls, vocab_parallel_cross_entropy
from tests.losses.reference import reference_cross_entropy

pytestmark = [
    pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a default group"),
    pytest.mark.skipif(native_ops() is None, reason="the native kernels do not build here"),
]

T, V = 37, 1000
OPTIONS = [
    {},
    {"temperature": 0.7},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-2},
    {"vocab_size": 990},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "temperature": 1.3, "vocab_size": 995},
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def small_l1(monkeypatch):
    # 1 KiB "L1d": 256-column chunks, 4 per 1000-column row
    monkeypatch.setattr(
        ce_kernel_calls, "cache_sizes", lambda: CacheSizes(l1d=1024, l2=1 << 20, source="test")
    )


def _inputs(dtype, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(T, V, generator=gen, dtype=torch.float64)).to(dtype)
    t = torch.randint(0, V, (T,), generator=gen)
    t[::5] = -100
    return x, t


def _run(backend, x, t, reduction, opts, inplace=False):
    leaf = x.clone().requires_grad_()
    with kernel_backend(backend):
        out = vocab_parallel_cross_entropy(leaf, t, reduction=reduction, inplace_backward=inplace, **opts)
        weight = torch.linspace(-1, 2, T) if reduction == "none" else torch.tensor(1.7)
        (out * weight).sum().backward()
    return out.detach(), leaf.grad, weight


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("opts", OPTIONS, ids=[str(o) for o in OPTIONS])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_native_matches_torch_blocks_and_reference(dtype, opts, reduction):
    x, t = _inputs(dtype)
    out_n, grad_n, weight = _run("native", x, t, reduction, opts)
    out_t, grad_t, _ = _run("torch", x, t, reduction, opts)
    ref_x = x.double().requires_grad_()
    ref = reference_cross_entropy(ref_x, t, reduction=reduction, **opts)
    (ref * weight.double()).sum().backward()
    torch.testing.assert_close(out_n.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_n, out_t, rtol=1e-5, atol=1e-5)
    assert grad_n.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(grad_n.double(), ref_x.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad_n, grad_t, rtol=1e-5, atol=1e-7)
    else:  # one bf16 rounding of the fp32 value
        torch.testing.assert_close(grad_n.double(), ref_x.grad, rtol=1e-2, atol=1e-5)
        torch.testing.assert_close(grad_n.float(), grad_t.float(), rtol=1e-2, atol=1e-6)
    assert torch.all(grad_n[t == -100] == 0)
    if opts.get("vocab_size"):
        assert torch.all(grad_n[:, opts["vocab_size"] :] == 0)


def test_extreme_logits_and_ignored_non_finite_rows():
    x, t = _inputs(torch.float32, seed=4)
    x[1, :500] = float("-inf")  # masked columns: probability 0
    x[2, 7] = 85.0  # exp near the float range
    x[3] = -80.0
    x[5] = float("nan")  # an ignored row (t[5] = -100 above): loss 0, gradient exactly 0
    t = t.clone()
    t[1] = 600
    assert t[5] == -100
    out_n, grad_n, _ = _run("native", x, t, "none", {})
    out_t, grad_t, _ = _run("torch", x, t, "none", {})
    torch.testing.assert_close(out_n, out_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_n, grad_t, rtol=1e-5, atol=1e-7)
    assert out_n[5] == 0 and torch.all(grad_n[5] == 0) and torch.all(grad_n[1, :500] == 0)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_inplace_backward_writes_into_the_logits(dtype):
    x, t = _inputs(dtype)
    leaf = x.clone().requires_grad_()
    storage = leaf.data_ptr()
    with kernel_backend("native"):
        (vocab_parallel_cross_entropy(leaf, t, reduction="mean", inplace_backward=True) * 1.7).backward()
    assert leaf.grad.data_ptr() == storage
    _, grad_t, _ = _run("torch", x, t, "mean", {})
    torch.testing.assert_close(
        leaf.grad.float(), grad_t.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-7
    )


def test_empty_inputs():
    for shape in ((0, V), (T, 0)):
        x = torch.randn(shape).requires_grad_()
        with kernel_backend("native"):
            # no columns at one rank: every target must be ignored
            t = torch.full((shape[0],), 0 if shape[1] else -100, dtype=torch.long)
            out = vocab_parallel_cross_entropy(x, t, reduction="sum")
            out.backward()
        assert x.grad.shape == x.shape


def test_forced_native_names_what_it_cannot_run():
    x, t = _inputs(torch.float64)
    with kernel_backend("native"), pytest.raises(RuntimeError, match="float64"):
        vocab_parallel_cross_entropy(x, t)
    with kernel_backend("native"), pytest.raises(RuntimeError, match="soft-capping"):
        vocab_parallel_cross_entropy(x.float(), t, softcap=3.0)


def test_kernel_checks_its_arguments():
    ops = native_ops()
    x = torch.randn(4, 8)
    idx, owned = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="index"):
        ops.ce_statistics(x, torch.full((4,), 9), owned, 8, 1.0, False, 256)
    with pytest.raises(RuntimeError, match="real width"):
        ops.ce_statistics(x, idx, owned, 9, 1.0, False, 256)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.ce_statistics(x.t(), idx, owned, 4, 1.0, False, 256)
