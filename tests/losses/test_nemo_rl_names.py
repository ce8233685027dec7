"""NeMo RL's current ``model_utils`` names (issue 28) against single-process references, tp / cp 1-3."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.losses import (
    AllGatherCPTensor,
    ChunkedDistributedLogprobWithSampling,
    DistributedCrossEntropy,
    DistributedLogprobWithSampling,
    _get_tokens_on_this_cp_rank,
    allgather_cp_sharded_tensor,
    cp_load_balanced_to_contiguous,
    cp_shift_next,
    group_all_reduce_sum,
    group_all_reduce_sum_with_grad,
    vocab_parallel_full_log_softmax,
    vocab_parallel_gather_columns,
    vocab_parallel_log_softmax,
)
from shardkit.testing import run_world
from tests.losses.reference import randint, randn, vocab_slice

VOCAB = 12  # divisible by 1, 2, 3: NeMo RL's even shards
SEQ = 12  # divisible by 2 * cp for cp 1, 2, 3


def _close(a, b):
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def _check_vocab(group, rank, world):
    start, end = vocab_slice(VOCAB, world, rank, even=True)
    X = randn((2, 5, VOCAB), 41)
    G = randn((2, 5, VOCAB), 42)
    for full in (False, True):
        fn = vocab_parallel_full_log_softmax if full else vocab_parallel_log_softmax
        x = X[..., start:end].clone().requires_grad_()
        out = fn(x, 0.7, tp_group=group)
        ref_x = X.clone().requires_grad_()
        ref = torch.log_softmax(ref_x / 0.7, -1)
        assert out.dtype == torch.float32
        _close(out, ref.detach() if full else ref.detach()[..., start:end])
        (out.double() * (G if full else G[..., start:end])).sum().backward()
        (ref * G).sum().backward()
        _close(x.grad, ref_x.grad[..., start:end])
    # gather columns
    cols = torch.tensor([3, 0, 11, 7, 3])
    Gc = randn((2, 5, 5), 43)
    x = X[..., start:end].clone().requires_grad_()
    out = vocab_parallel_gather_columns(x, cols, tp_group=group)
    ref_x = X.clone().requires_grad_()
    ref = ref_x[..., cols]
    _close(out, ref.detach())
    (out.double() * Gc).sum().backward()
    (ref * Gc).sum().backward()
    _close(x.grad, ref_x.grad[..., start:end])
    # soft-target cross-entropy: gradient to the student only
    T = randn((2, 5, VOCAB), 44)
    g = randn((2, 5), 45)
    s = X[..., start:end].clone().requires_grad_()
    t = T[..., start:end].clone().requires_grad_()
    out = DistributedCrossEntropy.apply(s, t, group)
    ref_s = X.clone().requires_grad_()
    ref = -(torch.softmax(T, -1) * torch.log_softmax(ref_s, -1)).sum(-1)
    _close(out, ref.detach())
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    _close(s.grad, ref_s.grad[..., start:end])
    assert t.grad is None
    _close(DistributedCrossEntropy.apply(s, t, group, True), ref.detach())
    with pytest.raises(ValueError, match="same shape"):
        DistributedCrossEntropy.apply(s, t[:, :2], group)
    # log-probs under the top-k / top-p filtered distribution
    target = X.argmax(-1)  # always kept by the filter: finite log-probs, a gradient everywhere
    target[0, 1] = 5
    for top_k, top_p in ((None, 1.0), (4, 1.0), (None, 0.8), (3, 0.9)):
        for chunked in (False, True):
            ref_x = X.clone().requires_grad_()
            filtered, _ = _reference_filter(ref_x, top_k, top_p)
            ref = torch.log_softmax(filtered, -1).gather(-1, target[..., None]).squeeze(-1)
            x = X[..., start:end].clone().requires_grad_()
            if chunked:
                out = ChunkedDistributedLogprobWithSampling.apply(x, target, group, top_k, top_p, 2)
            else:
                out = DistributedLogprobWithSampling.apply(x, target, group, top_k, top_p)
            torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
            finite = torch.isfinite(ref.detach())
            (out.double().where(finite, 0.0) * g).sum().backward()
            (ref.where(finite, 0.0) * g).sum().backward()
            _close(x.grad, ref_x.grad[..., start:end])


def _reference_filter(x, top_k, top_p):
    """Plain top-k then top-p (keep the smallest set of highest probabilities reaching ``top_p``)."""
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k is not None:
        kth = x.topk(top_k, -1).values[..., -1:]
        keep &= x >= kth
    masked = x.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(masked, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each entry
        keep_sorted = before < top_p
        keep = keep & torch.zeros_like(keep).scatter(-1, order, keep_sorted)
        masked = x.masked_fill(~keep, float("-inf"))
    return masked, keep


def _balanced_positions(length, cp, r):
    piece = length // (2 * cp)
    return list(range(r * piece, (r + 1) * piece)) + list(
        range((2 * cp - 1 - r) * piece, (2 * cp - r) * piece)
    )


def _check_cp(group, rank, world):
    X = randn((2, SEQ, 3), 51)
    own = torch.tensor(_balanced_positions(SEQ, world, rank))
    local = _get_tokens_on_this_cp_rank(X, rank, world, seq_dim=1)
    assert torch.equal(local, X[:, own])
    assert torch.equal(_get_tokens_on_this_cp_rank(X[0], rank, world, seq_dim=0), X[0, own])
    # each CP rank's loss its own (a rank-dependent weight): NeMo RL sums the gradient over the ranks
    weights = [randn((2, SEQ, 3), 60 + r) for r in range(world)]
    for gather in (allgather_cp_sharded_tensor, AllGatherCPTensor.apply):
        x = local.clone().requires_grad_()
        full = gather(x, group, 1)
        assert torch.equal(full, X)
        (full * weights[rank]).sum().backward()
        _close(x.grad, sum(weights)[:, own])
    x0 = X[0, own].clone().requires_grad_()
    assert torch.equal(allgather_cp_sharded_tensor(x0, group, seq_dim=0), X[0])
    # load-balanced -> contiguous window
    width = SEQ // world
    x = local.clone().requires_grad_()
    window = cp_load_balanced_to_contiguous(x, cp_group=group, seq_dim=1)
    assert torch.equal(window, X[:, rank * width : (rank + 1) * width])
    W = randn((2, SEQ, 3), 70)  # the global weight; each rank applies its window of it
    (window * W[:, rank * width : (rank + 1) * width]).sum().backward()
    _close(x.grad, W[:, own])
    # next-token shift over a contiguous split
    mine = X[:, rank * width : (rank + 1) * width]
    shifted = cp_shift_next(mine, group, fill=-7.0)
    ref = torch.cat([X[:, 1:], torch.full_like(X[:, :1], -7.0)], 1)[:, rank * width : (rank + 1) * width]
    assert torch.equal(shifted, ref)
    assert torch.equal(
        cp_shift_next(X, None, fill=0.5), torch.cat([X[:, 1:], torch.full_like(X[:, :1], 0.5)], 1)
    )
    # all-reduce sums
    values = [randn((4,), 80 + r) for r in range(world)]
    x = values[rank].clone().requires_grad_()
    total = group_all_reduce_sum_with_grad(x, group)
    _close(total, sum(values))
    g = randn((4,), 90)
    (total * g).sum().backward()
    _close(x.grad, g)
    constant = group_all_reduce_sum(x, group)
    _close(constant, sum(values))
    assert not constant.requires_grad
    assert group_all_reduce_sum_with_grad(x, None) is x


def _check():
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    _check_vocab(group, rank, world)
    _check_cp(group, rank, world)
    _check_logprobs(group, rank, world)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_nemo_rl_names_match_references(world_size):
    assert all(run_world(_check, world_size))


def test_nemo_rl_names_without_a_group_are_local():
    X = randn((2, 4, 6), 1)
    _close(vocab_parallel_log_softmax(X, 2.0), torch.log_softmax(X / 2.0, -1))
    _close(vocab_parallel_full_log_softmax(X, 1.0), torch.log_softmax(X, -1))
    _close(vocab_parallel_gather_columns(X, torch.tensor([5, 1])), X[..., [5, 1]])
    T = randn((2, 4, 6), 2)
    _close(
        DistributedCrossEntropy.apply(X, T, None), -(torch.softmax(T, -1) * torch.log_softmax(X, -1)).sum(-1)
    )
    assert torch.equal(_get_tokens_on_this_cp_rank(X, 0, 1), X)
    # inference_only: a result with no graph behind it
    from shardkit.losses import ChunkedDistributedGatherLogprob

    x = X.clone().requires_grad_()
    t = randint(6, (2, 4), 4)
    assert DistributedCrossEntropy.apply(x, T, None, True).grad_fn is None
    assert DistributedLogprobWithSampling.apply(x, t, None, 2, 1.0, True).grad_fn is None
    assert ChunkedDistributedLogprobWithSampling.apply(x, t, None, 2, 1.0, 2, True).grad_fn is None
    idx = randint(6, (2, 4, 2), 5)
    assert ChunkedDistributedGatherLogprob.apply(x, idx, 0, 6, 2, None, True).grad_fn is None
    _close(
        ChunkedDistributedGatherLogprob.apply(x, idx, 0, 6, 2, None), torch.log_softmax(X, -1).gather(-1, idx)
    )
    with pytest.raises(ValueError, match="multiple of 4"):
        _get_tokens_on_this_cp_rank(randint(9, (1, 6), 3), 0, 2)


def _check_logprobs(group, rank, world):
    from shardkit.losses import (
        ChunkedDistributedGatherLogprob,
        TrainingSamplingParams,
        all_to_all_sq2vp,
        all_to_all_vp2sq,
        get_distillation_topk_logprobs_from_logits,
        get_next_token_logprobs_from_logits,
    )

    start, end = vocab_slice(VOCAB, world, rank, even=True)
    X = randn((2, SEQ, VOCAB), 101)
    ids = randint(VOCAB, (2, SEQ), 102)
    # ChunkedDistributedGatherLogprob: log-probs at global ids
    gi = randint(VOCAB, (2, SEQ, 3), 103)
    Gk = randn((2, SEQ, 3), 104)
    x = X[..., start:end].clone().requires_grad_()
    out = ChunkedDistributedGatherLogprob.apply(x, gi, start, end, 4, group)
    ref_x = X.clone().requires_grad_()
    ref = torch.log_softmax(ref_x, -1).gather(-1, gi)
    _close(out, ref.detach())
    (out.double() * Gk).sum().backward()
    (ref * Gk).sum().backward()
    _close(x.grad, ref_x.grad[..., start:end])
    # next-token log-probs, vocab-parallel, with and without the sampler's filter
    G = randn((2, SEQ - 1), 105)
    for params in (None, TrainingSamplingParams(top_k=4, top_p=1.0)):
        x = X[..., start:end].clone().requires_grad_()
        out = get_next_token_logprobs_from_logits(
            ids, x, vocab_parallel_rank=rank, vocab_parallel_group=group, sampling_params=params
        )
        ref_x = X.clone().requires_grad_()
        z = ref_x[:, :-1] if params is None else _reference_filter(ref_x[:, :-1], 4, 1.0)[0]
        ref = torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        local = get_next_token_logprobs_from_logits(ids, X, sampling_params=params)  # one rank, whole vocab
        torch.testing.assert_close(local.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        finite = torch.isfinite(ref.detach())
        (out.double().where(finite, 0.0) * G).sum().backward()
        (ref.where(finite, 0.0) * G).sum().backward()
        _close(x.grad, ref_x.grad[..., start:end])
    # context parallelism: each rank a single-rank tensor-parallel group, the CP group all ranks
    singles = [dist.new_group([r]) for r in range(world)]
    own = torch.tensor(_balanced_positions(SEQ, world, rank))
    weights = [randn((2, SEQ - 1), 110 + r) for r in range(world)]
    x = X[:, own].clone().requires_grad_()
    out = get_next_token_logprobs_from_logits(
        ids, x, vocab_parallel_rank=0, vocab_parallel_group=singles[rank], context_parallel_group=group
    )
    ref_x = X.clone().requires_grad_()
    ref = torch.log_softmax(ref_x[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    _close(out, ref.detach())
    (out.double() * weights[rank]).sum().backward()
    (ref * sum(weights)).sum().backward()  # NeMo RL's rule: each CP rank's loss its own, summed
    _close(x.grad, ref_x.grad[:, own])
    # distillation top-k log-probs
    T = randn((2, SEQ, 3), 120)
    idx = randn((2, SEQ, VOCAB), 121).topk(3, -1).indices
    Gs, Gh = randn((2, SEQ - 1, 3), 122), randn((2, SEQ - 1), 123)
    teacher_ref = torch.log_softmax(T, -1)[:, :-1]
    layouts = [  # (student local logits, keyword arguments, this rank's (positions, columns))
        ("tp", dict(vocab_parallel_rank=rank, vocab_parallel_group=group)),
        ("cp", dict(vocab_parallel_rank=0, vocab_parallel_group=singles[rank], context_parallel_group=group)),
        ("cp-only", dict(context_parallel_group=group)),
    ]
    for zero_outside in (True, False):
        for name, kwargs in layouts:
            if name == "cp-only" and zero_outside:
                continue  # NeMo RL does no CP layout work on this path
            if name == "tp":
                x = X[..., start:end].clone().requires_grad_()
            else:
                x = X[:, own].clone().requires_grad_()
            s, t, h = get_distillation_topk_logprobs_from_logits(
                x, T, idx, zero_outside, zero_outside, **kwargs
            )
            ref_x = X.clone().requires_grad_()
            if zero_outside:
                logp = torch.log_softmax(ref_x, -1)
                ref_s, ref_h = logp.gather(-1, idx)[:, :-1], (logp.exp() * logp).sum(-1)[:, :-1]
            else:
                ref_s, ref_h = torch.log_softmax(ref_x.gather(-1, idx), -1)[:, :-1], None
            _close(s, ref_s.detach())
            _close(t, teacher_ref)
            loss = (s.double() * Gs).sum()
            ref_loss = (ref_s * Gs).sum()
            if zero_outside:
                _close(h, ref_h.detach())
                loss, ref_loss = loss + (h.double() * Gh).sum(), ref_loss + (ref_h * Gh).sum()
            else:
                assert h is None
            loss.backward()
            (ref_loss * (world if name != "tp" else 1)).backward()  # CP: every rank's loss, summed
            expected = ref_x.grad[..., start:end] if name == "tp" else ref_x.grad[:, own]
            _close(x.grad, expected)
    # DTensor logits sharded on the vocabulary (the mesh dimension named "tp", as NeMo RL's)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    dx = distribute_tensor(X.clone(), mesh, [Shard(2)]).requires_grad_()
    out = get_next_token_logprobs_from_logits(ids, dx)
    ref_x = X.clone().requires_grad_()
    ref = torch.log_softmax(ref_x[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    _close(out, ref.detach())
    (out.double() * G).sum().backward()
    (ref * G).sum().backward()
    _close(dx.grad.full_tensor(), ref_x.grad)
    dx = distribute_tensor(X.clone(), mesh, [Shard(2)])
    s, t, h = get_distillation_topk_logprobs_from_logits(dx, T, idx, True, True)
    logp = torch.log_softmax(X, -1)
    _close(s, logp.gather(-1, idx)[:, :-1])
    _close(h, (logp.exp() * logp).sum(-1)[:, :-1])
    # layout exchanges
    X2 = randn((6, VOCAB), 130)
    rows = 6 // world
    sq = all_to_all_vp2sq(X2[:, start:end].contiguous(), group)
    assert torch.equal(sq, X2[rank * rows : (rank + 1) * rows])
    assert torch.equal(all_to_all_sq2vp(sq, group), X2[:, start:end])
