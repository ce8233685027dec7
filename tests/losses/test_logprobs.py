"""Log-probs and log-softmax against torch on the gathered logits; no communication in backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.losses import (
    DistributedLogprob,
    _compute_distributed_log_softmax,
    checks,
    distributed_log_softmax,
    from_parallel_logits_to_logprobs,
    statistics,
    vocab_parallel_cross_entropy,
    vocab_parallel_logprobs,
)
from shardkit.testing import run_world
from tests.losses.reference import randint, randn, reference_logprobs, tolerances, vocab_slice

VOCAB = 13


def _check_logprobs():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        rtol, atol = tolerances(dtype)
        X = randn((2, 5, VOCAB), 11, dtype)
        t = randint(VOCAB, (2, 5), 12)
        W = randn((2, 5), 13)
        # DistributedLogprob, the specification's signature
        x = X[..., start:end].clone().requires_grad_()
        before = x.detach().clone()
        out = DistributedLogprob.apply(x, t, start, end, None, False)
        ref_x = X.to(torch.float64, copy=True).requires_grad_()
        ref = reference_logprobs(ref_x, t)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        (out * W.to(out.dtype)).sum().backward()
        (ref * W).sum().backward()
        torch.testing.assert_close(x.grad.double(), ref_x.grad[..., start:end], rtol=rtol, atol=atol)
        assert torch.equal(x.detach(), before)
        # options: soft-capping, temperature, a padded vocabulary, ignored tokens
        opts = {"softcap": 4.0, "temperature": 0.8, "vocab_size": 11}
        t_real = randint(11, (2, 5), 14)
        t_real[0, 0] = -1
        x = X[..., start:end].clone().requires_grad_()
        out = vocab_parallel_logprobs(
            x, t_real, vocab_start_index=start, vocab_end_index=end, ignore_index=-1, **opts
        )
        ref_x = X.to(torch.float64, copy=True).requires_grad_()
        ref = reference_logprobs(ref_x, t_real.clamp(min=0), **opts)
        ref = torch.where(t_real == -1, torch.zeros_like(ref), ref)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        (out * W.to(out.dtype)).sum().backward()
        (ref * W).sum().backward()
        torch.testing.assert_close(x.grad.double(), ref_x.grad[..., start:end], rtol=rtol, atol=atol)
        assert torch.all(x.grad[0, 0] == 0)
        # next-token log-probs [B, S - 1], in small chunks
        x = X[..., start:end].clone().requires_grad_()
        out = from_parallel_logits_to_logprobs(x, t, start, end, None, chunk_size=3)
        ref_x = X.to(torch.float64, copy=True).requires_grad_()
        ref = reference_logprobs(ref_x[:, :-1], t[:, 1:])
        assert out.shape == (2, 4)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        (out * W[:, :4].to(out.dtype)).sum().backward()
        (ref * W[:, :4]).sum().backward()
        torch.testing.assert_close(x.grad.double(), ref_x.grad[..., start:end], rtol=rtol, atol=atol)
        assert torch.all(x.grad[:, -1] == 0)
        # log-softmax: forward in the input dtype, backward with its one all-reduce
        for fn in (distributed_log_softmax, _compute_distributed_log_softmax):
            x = X[..., start:end].clone().requires_grad_()
            before = x.detach().clone()
            out = fn(x, None)
            ref_x = X.to(torch.float64, copy=True).requires_grad_()
            ref = torch.log_softmax(ref_x, -1)
            assert out.dtype == dtype
            torch.testing.assert_close(
                out.double(),
                ref[..., start:end].detach(),
                rtol=rtol,
                atol=max(atol, 1e-2 if dtype == torch.bfloat16 else 0),
            )
            G = randn(X.shape, 15)
            (out * G[..., start:end].to(dtype)).sum().backward()
            (ref * G.to(dtype).double()).sum().backward()
            torch.testing.assert_close(x.grad.double(), ref_x.grad[..., start:end], rtol=rtol, atol=atol)
            assert torch.equal(x.detach(), before)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_logprobs_and_log_softmax_match_torch(world_size):
    assert all(run_world(_check_logprobs, world_size))


def _forbid_collectives(monkeypatch_targets):
    def refuse(*args, **kwargs):
        raise AssertionError("a collective was called in backward")

    saved = [(obj, name, getattr(obj, name)) for obj, name in monkeypatch_targets]
    for obj, name, _ in saved:
        setattr(obj, name, refuse)
    return saved


def _check_backward_is_local_and_inference_saves_nothing():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    X, t = randn((3, 4, VOCAB), 16, torch.bfloat16), randint(VOCAB, (3, 4), 17)
    x = X[..., start:end].clone().requires_grad_()
    outs = [
        DistributedLogprob.apply(x, t, start, end, None),
        vocab_parallel_cross_entropy(x, t, vocab_start_index=start, vocab_end_index=end, label_smoothing=0.1),
        from_parallel_logits_to_logprobs(x, t, start, end, None),
    ]
    targets = [
        (dist, "all_reduce"),
        (dist, "all_gather"),
        (dist, "all_gather_into_tensor"),
        (dist, "broadcast"),
        (statistics, "all_gather_flat"),
        (checks, "all_gather_flat"),
    ]
    saved = _forbid_collectives(targets)
    try:
        for out in outs:
            out.sum().backward()
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    # inference_only and no-grad calls save no tensor for backward
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: packed.append(s) or s, lambda s: s):
        out = DistributedLogprob.apply(x, t, start, end, None, True)
        assert out.grad_fn is not None  # a node exists, but it holds nothing
        out2 = from_parallel_logits_to_logprobs(x, t, start, end, None, inference_only=True)
        out3 = vocab_parallel_logprobs(
            x, t, vocab_start_index=start, vocab_end_index=end, inference_only=True
        )
        with torch.no_grad():
            out4 = distributed_log_softmax(x)
    assert packed == []
    assert out2.grad_fn is None and out3.grad_fn is None and out4.grad_fn is None
    assert len(out.grad_fn.saved_tensors) == 0
    with pytest.raises(RuntimeError, match="inference_only"):
        out.sum().backward()
    return True


def test_backward_needs_no_communication_and_inference_saves_nothing():
    assert all(run_world(_check_backward_is_local_and_inference_saves_nothing, 2))
