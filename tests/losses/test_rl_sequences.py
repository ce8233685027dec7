"""Context-parallel, packed and chunked log-probs against torch on the full, unsplit sequence."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.losses import (
    ChunkedDistributedLogprob,
    DistributedLogprob,
    TrainingSamplingParams,
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
)
from shardkit.losses.context_parallel import context_parallel_positions, segment_bounds
from shardkit.testing import run_world
from tests.losses.reference import randint, randn, reference_logprobs, tolerances, vocab_slice

VOCAB = 13


def _grid(tp):
    """``(tp_group, tp_rank, cp_group, cp_rank, cp)``: ranks ``arange(world).reshape(cp, tp)``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world // tp
    table = torch.arange(world).reshape(cp, tp)
    tp_groups = [dist.new_group(row.tolist()) for row in table]  # every rank creates every group
    cp_groups = [dist.new_group(col.tolist()) for col in table.t()]
    row, col = divmod(rank, tp)
    return tp_groups[row], col, cp_groups[col], row, cp


def _check_context_parallel(tp):
    tp_group, tp_rank, cp_group, cp_rank, cp = _grid(tp)
    start, end = vocab_slice(VOCAB, tp, tp_rank)
    results = []
    for dtype in (torch.float64, torch.bfloat16):
        rtol, atol = tolerances(dtype)
        S = 4 * cp
        for target_len in (S, S - 1):  # the logits may be padded past the real sequence
            X = randn((2, S, VOCAB), 50, dtype)
            t = randint(VOCAB, (2, target_len), 51)
            G = randn((2, target_len - 1), 52)
            positions = context_parallel_positions([(0, S)], cp, cp_rank, torch.device("cpu"))
            x = X[:, positions, start:end].clone().requires_grad_()
            out = from_parallel_logits_to_logprobs(x, t, start, end, tp_group, False, cp_group)
            work = torch.float64 if dtype == torch.float64 else torch.float32
            assert out.shape == (2, target_len - 1) and out.dtype == work
            ref_x = X.to(torch.float64, copy=True).requires_grad_()
            ref = reference_logprobs(ref_x[:, : target_len - 1], t[:, 1:])
            torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
            (out * G.to(out.dtype)).sum().backward()  # the same loss on every CP rank
            (ref * G).sum().backward()
            expected = ref_x.grad[:, positions, start:end]
            torch.testing.assert_close(x.grad.double(), expected, rtol=rtol, atol=atol)
            results.append((dtype, target_len))
    return len(results)


@pytest.mark.parametrize("world_size, tp", [(2, 1), (3, 1), (4, 2)])
def test_context_parallel_logprobs_equal_cp_one(world_size, tp):
    assert run_world(_check_context_parallel, world_size, tp) == [4] * world_size


def _check_packed(tp):
    tp_group, tp_rank, cp_group, cp_rank, cp = _grid(tp)
    start, end = vocab_slice(VOCAB, tp, tp_rank)
    unit = 2 * cp
    lengths = [unit, 2 * unit, unit]  # padded lengths, multiples of 2 * cp
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    T = int(cu[-1])
    X = randn((1, T, VOCAB), 53)
    t = randint(VOCAB, (1, T), 54)
    unpacked = max(lengths) + 1  # one more than the longest: the trailing column stays zero
    G = randn((len(lengths), unpacked - 1), 55)
    bounds = segment_bounds(cu, T)
    positions = context_parallel_positions(bounds, cp, cp_rank, torch.device("cpu"))
    x = X[:, positions, start:end].clone().requires_grad_()
    out = from_parallel_logits_to_logprobs_packed_sequences(
        x, t, cu, unpacked, start, end, tp_group, False, cp_group if cp > 1 else None, 2
    )
    ref_x = X.clone().requires_grad_()
    rows = []
    for s, e in bounds:
        # each sequence on its own: no score crosses a boundary
        seq = reference_logprobs(ref_x[0, s : e - 1], t[0, s + 1 : e])
        rows.append(torch.cat([seq, seq.new_zeros(unpacked - 1 - seq.numel())]))
    ref = torch.stack(rows)
    torch.testing.assert_close(out, ref.detach())
    (out * G).sum().backward()
    (ref * G).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad[:, positions, start:end])
    return True


@pytest.mark.parametrize("world_size, tp", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_packed_sequences_never_score_across_a_boundary(world_size, tp):
    assert all(run_world(_check_packed, world_size, tp))


def test_segment_layout_is_checked():
    with pytest.raises(ValueError, match="cu_seqlens"):
        segment_bounds(torch.tensor([0, 5, 3]), 3)
    with pytest.raises(ValueError, match="multiple of 4"):
        context_parallel_positions([(0, 6)], 2, 0, torch.device("cpu"))
    # load balance: rank 0 holds pieces 0 and 3, rank 1 pieces 1 and 2, in every sequence
    bounds = [(0, 4), (4, 12)]
    assert context_parallel_positions(bounds, 2, 0, torch.device("cpu")).tolist() == [0, 3, 4, 5, 10, 11]
    assert context_parallel_positions(bounds, 2, 1, torch.device("cpu")).tolist() == [1, 2, 6, 7, 8, 9]


def _check_chunked():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        rtol, atol = tolerances(dtype)
        X = randn((3, 7, VOCAB), 56, dtype)
        t = randint(VOCAB, (3, 7), 57)
        G = randn((3, 7), 58)
        grads = []
        for fn in (
            lambda x, t=t: ChunkedDistributedLogprob.apply(x, t, start, end, 2, None, False),
            lambda x, t=t: DistributedLogprob.apply(x, t, start, end, None, False),
        ):
            x = X[..., start:end].clone().requires_grad_()
            out = fn(x)
            ref_x = X.to(torch.float64, copy=True).requires_grad_()
            ref = reference_logprobs(ref_x, t)
            torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
            (out * G.to(out.dtype)).sum().backward()
            (ref * G).sum().backward()
            torch.testing.assert_close(x.grad.double(), ref_x.grad[..., start:end], rtol=rtol, atol=atol)
            grads.append(x.grad)
        # chunking changes the blocks, not the arithmetic of a row
        assert torch.equal(grads[0], grads[1])
    out = ChunkedDistributedLogprob.apply(X[..., start:end].requires_grad_(), t, start, end, 3, None, True)
    with pytest.raises(RuntimeError, match="inference_only"):
        out.sum().backward()
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedDistributedLogprob.apply(X[..., start:end], t, start, end, 0, None, False)
    return True


@pytest.mark.parametrize("world_size", [1, 3])
def test_chunked_logprobs_match_torch(world_size):
    assert all(run_world(_check_chunked, world_size))


def _reference_filtered_logprobs(z, target, top_k, top_p):
    """Log-probs ``[N]`` under a top-k then top-p filter, on full ``[N, V]`` float64 logits (no ties)."""
    keep = z >= z.topk(top_k, dim=-1).values[:, -1:]
    probs = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(-1) - ordered  # mass of the tokens ranked above each one
    keep &= torch.zeros_like(keep).scatter(-1, order, before < top_p)
    return torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1).gather(-1, target[:, None])[:, 0]


def _check_nemo_rl_options(tp):
    """target_is_pre_rolled, sampling_params and cp_gradient="sum" against the full-sequence reference."""
    tp_group, tp_rank, cp_group, cp_rank, cp = _grid(tp)
    start, end = vocab_slice(VOCAB, tp, tp_rank)
    unit = 2 * cp
    lengths = [2 * unit, unit, 3 * unit]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    T, unpacked = int(cu[-1]), max(lengths)
    X, t, G = randn((1, T, VOCAB), 60), randint(VOCAB, (1, T), 61), randn((len(lengths), unpacked - 1), 62)
    bounds = segment_bounds(cu, T)
    positions = context_parallel_positions(bounds, cp, cp_rank, torch.device("cpu"))
    group = cp_group if cp > 1 else None

    def run(target, weight=1.0, **options):
        x = X[:, positions, start:end].clone().requires_grad_()
        out = from_parallel_logits_to_logprobs_packed_sequences(
            x, target, cu, unpacked, start, end, tp_group, False, group, **options
        )
        (out.masked_fill(~out.isfinite(), 0.0) * G * weight).sum().backward()
        return out.detach(), x.grad

    plain, plain_grad = run(t)
    # NeMo RL's pre-rolled target: rolled by one inside each sequence, then split like the logits
    rolled = torch.cat([t[:, s:e].roll(-1, dims=1) for s, e in bounds], dim=1)
    pre, pre_grad = run(rolled[:, positions], target_is_pre_rolled=True)
    assert torch.equal(pre, plain) and torch.equal(pre_grad, plain_grad)
    with pytest.raises(ValueError, match="target_is_pre_rolled"):
        run(t, target_is_pre_rolled=True) if cp > 1 else run(t[:, :-1], target_is_pre_rolled=True)

    # sampling_params: the filtered, renormalized distribution (a dict with the filter off is plain)
    off, _ = run(t, sampling_params={"top_k": -1, "top_p": 1.0})
    assert torch.equal(off, plain)
    sampled, sampled_grad = run(t, sampling_params=TrainingSamplingParams(top_k=6, top_p=0.7))
    ref_x = X[0].clone().requires_grad_()
    rows = []
    for s, e in bounds:
        seq = _reference_filtered_logprobs(ref_x[s : e - 1], t[0, s + 1 : e], 6, 0.7)
        rows.append(torch.cat([seq, seq.new_zeros(unpacked - 1 - seq.numel())]))
    ref = torch.stack(rows)
    assert (~ref.isfinite()).any() and ref.isfinite().any()  # both kinds of target occur
    torch.testing.assert_close(sampled, ref.detach())
    (ref.masked_fill(~ref.isfinite(), 0.0) * G).sum().backward()
    torch.testing.assert_close(sampled_grad, ref_x.grad[None, positions, start:end])

    # cp_gradient="sum": each CP rank's loss its own (weight r + 1); the gradient sums them
    own_grad = run(t, weight=cp_rank + 1.0)[1]
    summed_grad = run(t, weight=cp_rank + 1.0, cp_gradient="sum")[1]
    torch.testing.assert_close(own_grad, plain_grad * (cp_rank + 1))
    torch.testing.assert_close(summed_grad, plain_grad * (cp * (cp + 1) / 2))
    with pytest.raises(ValueError, match="cp_gradient"):
        run(t, cp_gradient="mean")
    return True


@pytest.mark.parametrize("world_size, tp", [(1, 1), (2, 1), (4, 2)])
def test_nemo_rl_options_match_the_reference(world_size, tp):
    assert all(run_world(_check_nemo_rl_options, world_size, tp))
