"""Fused linear cross-entropy / log-probs against F.linear + the loss on the gathered weight."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.losses import vocab_parallel_linear_cross_entropy, vocab_parallel_linear_logprobs
from shardkit.testing import run_world
from tests.losses.reference import randint, randn, reference_cross_entropy, reference_logprobs, vocab_slice

VOCAB, HIDDEN = 13, 6
OPTION_SETS = [
    {},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 3.0, "temperature": 1.3, "vocab_size": 11},
]


def _tol(dtype):
    # bf16: logits and hidden gradients are bf16 matmuls, as in the unfused layer
    return (1e-10, 1e-12) if dtype == torch.float64 else (3e-2, 3e-2)


def _check_fused():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    checked = 0
    for dtype in (torch.float64, torch.bfloat16):
        rtol, atol = _tol(dtype)
        Hs, Ws = randn((2, 5, HIDDEN), 21, dtype), randn((VOCAB, HIDDEN), 22, dtype)
        for opts in OPTION_SETS:
            t = randint(opts.get("vocab_size", VOCAB), (2, 5), 23)
            t[1, ::2] = -100
            # the recomputing backward, and gradients computed in forward (fp32 / fp64 scalar losses)
            modes = [("none", None), ("mean", False)]
            if dtype == torch.float64:
                modes += [("mean", True), ("sum", True)]
            for reduction, grad_in_forward in modes:
                h = Hs.clone().requires_grad_()
                w = Ws[start:end].clone().requires_grad_()
                out = vocab_parallel_linear_cross_entropy(
                    h,
                    w,
                    t,
                    vocab_start_index=start,
                    vocab_end_index=end,
                    reduction=reduction,
                    chunk_size=3,
                    grad_in_forward=grad_in_forward,
                    **opts,
                )
                ref_h = Hs.to(torch.float64, copy=True).requires_grad_()
                ref_w = Ws.to(torch.float64, copy=True).requires_grad_()
                logits = ref_h @ ref_w.t()
                if dtype == torch.bfloat16:  # the layer produces bf16 logits
                    logits = logits + ((Hs @ Ws.t()).double() - logits).detach()
                ref = reference_cross_entropy(logits, t, reduction=reduction, **opts)
                torch.testing.assert_close(out.double(), ref.detach(), rtol=rtol, atol=atol)
                G = randn(out.shape, 24)
                (out * G.to(out.dtype)).sum().backward()
                (ref * G).sum().backward()
                assert h.grad.dtype == dtype and w.grad.dtype == dtype
                torch.testing.assert_close(h.grad.double(), ref_h.grad, rtol=rtol, atol=atol)
                torch.testing.assert_close(w.grad.double(), ref_w.grad[start:end], rtol=rtol, atol=atol)
                assert torch.equal(h.detach(), Hs) and torch.equal(w.detach(), Ws[start:end])
                checked += 1
        # log-probs, and the partial hidden gradient for callers that reduce it themselves
        t = randint(VOCAB, (2, 5), 25)
        h = Hs.clone().requires_grad_()
        w = Ws[start:end].clone().requires_grad_()
        out = vocab_parallel_linear_logprobs(
            h, w, t, vocab_start_index=start, vocab_end_index=end, reduce_hidden_grad=False
        )
        ref_h = Hs.to(torch.float64, copy=True).requires_grad_()
        ref = reference_logprobs(ref_h @ Ws.double().t(), t)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=rtol, atol=atol)
        out.sum().backward()
        ref.sum().backward()
        partial = h.grad.double()
        dist.all_reduce(partial)
        torch.testing.assert_close(partial, ref_h.grad, rtol=rtol, atol=atol)
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fused_linear_matches_unfused(world_size):
    assert run_world(_check_fused, world_size) == [(4 + 2) * len(OPTION_SETS)] * world_size


def _check_saves_no_logits():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    T = 16
    h = randn((T, HIDDEN), 26, torch.bfloat16).requires_grad_()
    w = randn((VOCAB, HIDDEN), 27, torch.bfloat16)[start:end].clone().requires_grad_()
    t = randint(VOCAB, (T,), 28)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: packed.append(s) or s, lambda s: s):
        out = vocab_parallel_linear_cross_entropy(
            h, w, t, vocab_start_index=start, vocab_end_index=end, reduction="mean", chunk_size=4
        )
    inputs = {h.data_ptr(), w.data_ptr(), t.data_ptr()}
    # the inputs by reference, plus per-token statistics: no [T, V/tp] logits tensor
    assert all(s.data_ptr() in inputs or s.numel() <= T for s in packed), [tuple(s.shape) for s in packed]
    out.backward()
    packed.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda s: packed.append(s) or s, lambda s: s):
        out = vocab_parallel_linear_logprobs(
            h, w, t, vocab_start_index=start, vocab_end_index=end, inference_only=True
        )
    assert packed == [] and out.grad_fn is None
    return True


def test_fused_linear_saves_no_logits():
    assert all(run_world(_check_saves_no_logits, 2))


def _check_gradients_in_forward():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    T = 16
    h = randn((T, HIDDEN), 30, torch.float32).requires_grad_()
    w = randn((VOCAB, HIDDEN), 31, torch.float32)[start:end].clone().requires_grad_()
    t = randint(VOCAB, (T,), 32)
    kwargs = dict(vocab_start_index=start, vocab_end_index=end, reduction="mean", chunk_size=5)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: packed.append(s) or s, lambda s: s):
        out = vocab_parallel_linear_cross_entropy(h, w, t, **kwargs)
    assert packed == []  # the default for an fp32 mean: gradients made in forward, no input kept
    (out * 3.0).backward(retain_graph=True)  # the incoming gradient scales the buffers
    fast = (h.grad.clone(), w.grad.clone())
    (out * 2.0).backward()  # a retained graph backpropagates through the same buffers again
    torch.testing.assert_close((h.grad, w.grad), (fast[0] * 5 / 3, fast[1] * 5 / 3))
    h.grad = w.grad = None
    (vocab_parallel_linear_cross_entropy(h, w, t, grad_in_forward=False, **kwargs) * 3.0).backward()
    torch.testing.assert_close(fast, (h.grad, w.grad), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="grad_in_forward=True needs"):
        vocab_parallel_linear_cross_entropy(h.bfloat16(), w.bfloat16(), t, grad_in_forward=True, **kwargs)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_gradients_in_forward_are_scaled_by_the_incoming_gradient(world_size):
    assert all(run_world(_check_gradients_in_forward, world_size))


def test_linear_block_rows_on_and_off_the_cpu():
    from shardkit.losses import statistics as st

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    # CPU: at least 256 rows (chunk_rows's 65 would re-read the weight every 65 tokens), aligned,
    # never more than the tokens, chunk_rows where that is larger, the caller's chunk_size first
    assert st.chunk_rows(128000, None) == 65
    assert st.linear_chunk_rows(128000, 16384, 4096, cpu, None) == st.LINEAR_CPU_MIN_ROWS == 256
    assert st.linear_chunk_rows(128000, 100, 4096, cpu, None) == 100
    assert st.linear_chunk_rows(8000, 16384, 4096, cpu, None) == st.aligned(st.chunk_rows(8000, None)) == 1088
    assert st.linear_chunk_rows(128000, 16384, 4096, cpu, 7) == 7
    # ceil(16384 * 4096 / 128000) = 525, rounded up to a multiple of 64 for the GEMM kernels
    assert st.linear_chunk_rows(128000, 16384, 4096, gpu, None) == 576
    assert st.linear_chunk_rows(1000, 10, 4096, gpu, None) == 10  # never more than the tokens
    assert st.linear_chunk_rows(128000, 1000, 8, gpu, None) == 128  # never less than chunk_rows (65)
    assert st.linear_chunk_rows(128000, 16384, 4096, gpu, 7) == 7  # the caller's chunk_size wins
