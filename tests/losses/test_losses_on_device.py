"""The vocab-parallel losses on one device without a group, against PyTorch's functions on the CPU.

Runs on ``cpu`` (default, native C++ kernels forced, pure-torch blocks forced) in the normal suite
and on ``cuda`` where a GPU exists (marked ``cuda``;
``tools/device_check.sh`` runs them on a GPU machine). On CUDA the plain loss runs the Triton
cross-entropy kernels by default: the ``triton`` case forces them (an error if they cannot run the
call) and the ``auto`` case checks the default glue; the smoothed loss takes the torch blocks there.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.kernels import kernel_backend
from shardkit.losses import (
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_logprobs,
)

pytestmark = pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a default group")

T, V, H = 67, 1000, 24  # V not a multiple of any block width
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# (device, backend forced or None)
PATHS = [
    pytest.param("cpu", None, id="cpu"),
    # the native C++ kernels (fp32 / bf16 on CPU; built on this machine) and the pure-torch blocks
    pytest.param("cpu", "native", id="cpu-native"),
    pytest.param("cpu", "torch", id="cpu-torch"),
    pytest.param("cuda", None, id="cuda-auto", marks=CUDA),
    pytest.param("cuda", "triton", id="cuda-triton", marks=CUDA),
    pytest.param("cuda", "torch", id="cuda-torch", marks=CUDA),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# bf16 inputs are compared with fp32 math on the same (rounded) values; the gradient is stored in bf16
GRAD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=2e-3)}
LOSS_TOL = dict(rtol=1e-4, atol=1e-4)


def _inputs(device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(T, V, generator=gen)).to(dtype)
    target = torch.randint(0, V, (T,), generator=gen)
    target[::7] = -100
    return logits.to(device, copy=True).requires_grad_(), target.to(device), logits.float().clone()


def _backend(name):
    return kernel_backend(name) if name is not None else contextlib.nullcontext()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("device, backend", PATHS)
def test_cross_entropy(device, backend, dtype):
    logits, target, ref_logits = _inputs(device, dtype)
    ref_logits.requires_grad_()
    with _backend(backend):
        loss = vocab_parallel_cross_entropy(logits, target, reduction="mean")
        loss.backward()
    ref = F.cross_entropy(ref_logits, target.cpu(), ignore_index=-100)
    ref.backward()
    assert loss.device.type == device
    torch.testing.assert_close(loss.detach().cpu().float(), ref.detach(), **LOSS_TOL)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.cpu().float(), ref_logits.grad, **GRAD_TOL[dtype])


@pytest.mark.parametrize("device, backend", [p for p in PATHS if p.values[1] != "triton"])
def test_label_smoothing_takes_the_torch_blocks(device, backend):
    logits, target, ref_logits = _inputs(device, torch.float32)
    with _backend(backend):
        loss = vocab_parallel_cross_entropy(logits, target, 0.1, reduction="none")
    ref = F.cross_entropy(ref_logits, target.cpu(), ignore_index=-100, label_smoothing=0.1, reduction="none")
    torch.testing.assert_close(loss.detach().cpu(), ref, **LOSS_TOL)


@pytest.mark.parametrize("device, backend", PATHS)
def test_logprobs(device, backend):
    logits, target, ref_logits = _inputs(device, torch.float32)
    target = target.clamp(min=0)
    with _backend(backend):
        logprobs = vocab_parallel_logprobs(logits, target)
    ref = torch.log_softmax(ref_logits, -1).gather(-1, target.cpu()[:, None])[:, 0]
    torch.testing.assert_close(logprobs.detach().cpu(), ref, **LOSS_TOL)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("device, backend", PATHS)
def test_fused_linear_cross_entropy(device, backend, dtype):
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(dtype)
    target = torch.randint(0, V, (T,), generator=gen)
    target[::5] = -100
    # separate leaves (on the CPU in fp32, .float() and .to("cpu") would return the same tensor)
    ref_hidden, ref_weight = hidden.float().clone().requires_grad_(), weight.float().clone().requires_grad_()
    hidden = hidden.to(device, copy=True).requires_grad_()
    weight = weight.to(device, copy=True).requires_grad_()
    with _backend(backend):
        loss = vocab_parallel_linear_cross_entropy(hidden, weight, target.to(device), reduction="mean")
        loss.backward()
    ref = F.cross_entropy(ref_hidden @ ref_weight.t(), target, ignore_index=-100)
    ref.backward()
    # bf16: the logits of the fused loss are rounded to bf16 after the matmul, as the unfused
    # linear + loss in bf16 would be
    loss_tol = LOSS_TOL if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(loss.detach().cpu().float(), ref.detach(), **loss_tol)
    grad_tol = GRAD_TOL[dtype] if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(hidden.grad.cpu().float(), ref_hidden.grad, **grad_tol)
    torch.testing.assert_close(weight.grad.cpu().float(), ref_weight.grad, **grad_tol)
