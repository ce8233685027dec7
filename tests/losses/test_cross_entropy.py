"""Vocab-parallel cross-entropy against F.cross_entropy on the gathered logits, at tp 1, 2, 3, 4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.losses import (
    CrossEntropyFunction,
    ParallelCrossEntropy,
    TEParallelCrossEntropy,
    parallel_cross_entropy,
    vocab_parallel_cross_entropy,
)
from shardkit.testing import run_world
from tests.losses.reference import (
    randint,
    randn,
    reference_cross_entropy,
    tolerances,
    vocab_slice,
)

# 13 columns split unevenly at 2, 3 and 4 ranks (array_split: e.g. 4, 3, 3, 3); the last two are padding
# in the padded-vocabulary cases
VOCAB = 13
OPTION_SETS = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-2},
    {"softcap": 2.0},
    {"temperature": 0.7},
    {"vocab_size": 11},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 3.0, "temperature": 1.3, "vocab_size": 11},
]


def _targets(shape, vocab, seed, ignore_index=-100):
    t = randint(vocab, shape, seed)
    t.view(-1)[::4] = ignore_index  # every fourth token is ignored
    return t


def _check_options(world, rank):
    checked = 0
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        rtol, atol = tolerances(dtype)
        X = randn((2, 5, VOCAB), 1, dtype)
        start, end = vocab_slice(VOCAB, world, rank)
        for opts in OPTION_SETS:
            t = _targets((2, 5), opts.get("vocab_size", VOCAB), 2)
            for reduction in ("none", "sum", "mean"):
                x = X[..., start:end].clone().requires_grad_()
                x_before, t_before = x.detach().clone(), t.clone()
                out = vocab_parallel_cross_entropy(
                    x, t, vocab_start_index=start, vocab_end_index=end, reduction=reduction, **opts
                )
                ref_x = X.to(torch.float64, copy=True).requires_grad_()
                ref = reference_cross_entropy(ref_x, t, reduction=reduction, **opts)
                assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
                torch.testing.assert_close(
                    out.double(), ref.detach(), rtol=max(rtol, 1e-5), atol=max(atol, 1e-5)
                )
                weight = (
                    randn(out.shape, 3) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
                )
                (out * weight.to(out.dtype)).sum().backward()
                (ref * weight).sum().backward()
                assert x.grad.dtype == dtype and x.grad.shape == x.shape
                torch.testing.assert_close(x.grad.double(), ref_x.grad[..., start:end], rtol=rtol, atol=atol)
                # ignored tokens: exactly zero gradient; inputs untouched by forward and backward
                assert torch.all(x.grad[t == -100] == 0)
                assert torch.equal(x.detach(), x_before) and torch.equal(t, t_before)
                checked += 1
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_options_match_torch(world_size):
    expected = 3 * len(OPTION_SETS) * 3
    assert run_world(_check_options_entry, world_size) == [expected] * world_size


def _check_options_entry():
    return _check_options(dist.get_world_size(), dist.get_rank())


def _check_spec_api():
    world, rank = dist.get_world_size(), dist.get_rank()
    vocab = 12  # even shards at 1, 2, 3 and 4 ranks
    start, end = vocab_slice(vocab, world, rank, even=True)
    for dtype in (torch.float32, torch.bfloat16):
        rtol, atol = tolerances(dtype)
        X = randn((3, 4, vocab), 4, dtype)
        t = _targets((3, 4), vocab, 5)
        for smoothing in (0.0, 0.1):
            for reduce_loss in (False, True):
                # [B, S, V/tp] and the [S, B, V/tp] layout (target follows the logits' leading dims)
                for logits, target in ((X, t), (X.transpose(0, 1).contiguous(), t.t().contiguous())):
                    x = logits[..., start:end].clone().requires_grad_()
                    ref_x = logits.to(torch.float64, copy=True).requires_grad_()
                    ref = reference_cross_entropy(
                        ref_x, target, label_smoothing=smoothing, reduction="mean" if reduce_loss else "none"
                    )
                    for fn in ("function", "apply"):
                        x.grad = None
                        if fn == "function":
                            out = parallel_cross_entropy(x, target, smoothing, reduce_loss, None, -100)
                        else:
                            out = CrossEntropyFunction.apply(x, target, smoothing, reduce_loss, None, -100)
                        assert out.dtype == torch.float32 and out.shape == ref.shape
                        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
                        out.sum().backward()
                        if fn == "function":
                            ref.sum().backward()
                        torch.testing.assert_close(
                            x.grad.double(), ref_x.grad[..., start:end], rtol=rtol, atol=atol
                        )
        # the module front end, its mask and its reductions; the labels are never modified
        mask = torch.ones(3, 4, dtype=torch.bool)
        mask[0, 1:3] = False
        labels_before = t.clone()
        for reduction in ("none", "sum", "mean"):
            loss_fn = TEParallelCrossEntropy(ignore_index=-100, reduction=reduction, tp_group=None)
            x = X[..., start:end].clone().requires_grad_()
            out = loss_fn(x, t, mask=mask)
            masked = torch.where(mask, t, torch.full_like(t, -100))
            ref = reference_cross_entropy(X.double(), masked, reduction=reduction)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
            out.sum().backward()
            assert torch.all(x.grad[~mask] == 0)
            assert torch.equal(t, labels_before)
    assert ParallelCrossEntropy is TEParallelCrossEntropy
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_specification_api(world_size):
    assert all(run_world(_check_spec_api, world_size))


def _check_all_ignored_and_dp_mean():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    X = randn((6, VOCAB), 6)
    results = {}
    t = torch.full((6,), -100)
    for reduction in ("none", "sum", "mean"):
        x = X[:, start:end].clone().requires_grad_()
        out = vocab_parallel_cross_entropy(
            x, t, vocab_start_index=start, vocab_end_index=end, reduction=reduction
        )
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.all(out == 0)
        assert torch.all(x.grad == 0)
        results[reduction] = out.sum().item()
    # global mean over a data-parallel group: here every rank is its own dp replica holding different
    # tokens (tp = 1), so the mean is over all ranks' non-ignored tokens
    group_of_one = [dist.new_group([r]) for r in range(world)][rank]
    Xs = randn((world, 5, VOCAB), 7)
    ts = randint(VOCAB, (world, 5), 8)
    ts[ts % 3 == 0] = -100
    x = Xs[rank].clone().requires_grad_()
    out = vocab_parallel_cross_entropy(x, ts[rank], group_of_one, reduction="mean", dp_group=dist.group.WORLD)
    ref_x = Xs.clone().requires_grad_()
    ref = reference_cross_entropy(ref_x.reshape(-1, VOCAB), ts.reshape(-1), reduction="mean")
    torch.testing.assert_close(out, ref.detach())
    out.backward()
    ref.backward()
    # each rank's gradient is its own tokens' part of the global mean
    torch.testing.assert_close(x.grad, ref_x.grad[rank])
    return results


@pytest.mark.parametrize("world_size", [1, 3])
def test_all_ignored_batch_and_global_mean(world_size):
    for result in run_world(_check_all_ignored_and_dp_mean, world_size):
        assert result == {"none": 0.0, "sum": 0.0, "mean": 0.0}


def _count_saved(fn):
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _check_saved_tensors():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    X, t = randn((4, 6, VOCAB), 9, torch.bfloat16), _targets((4, 6), VOCAB, 10)
    x = X[..., start:end].clone().requires_grad_()
    kwargs = dict(vocab_start_index=start, vocab_end_index=end, label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    with torch.no_grad():
        out, saved = _count_saved(lambda: vocab_parallel_cross_entropy(x, t, **kwargs))
    assert saved == [] and out.grad_fn is None
    out, saved = _count_saved(lambda: vocab_parallel_cross_entropy(x, t, **kwargs))
    # the logits are saved by reference (no copy); everything else is per token
    big = [s for s in saved if s.numel() >= x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()
    assert all(s.numel() <= t.numel() for s in saved if s.data_ptr() != x.data_ptr())
    # exactly what the docs list: the logits and target by reference, lse [T] fp32 (the one new
    # per-token tensor, as in TE's kernel), the token count and the vocabulary size (0-d scalars)
    refs = (x.data_ptr(), t.data_ptr())
    by_ref = [s for s in saved if s.data_ptr() in refs]
    new = sorted(((tuple(s.shape), s.dtype) for s in saved if s.data_ptr() not in refs), key=str)
    assert len(by_ref) == 2 and len(saved) == 5
    assert new[-1] == ((t.numel(),), torch.float32) and all(shape == () for shape, _ in new[:-1])
    return True


@pytest.mark.parametrize("world_size", [2])
def test_saves_only_a_reference_and_per_token_statistics(world_size):
    assert all(run_world(_check_saved_tensors, world_size))


# ---------------------------------------------------------------------------------------------------
# drop-in calls: Megatron's positional label_smoothing, TE / NeMo Automodel's names

EVEN_VOCAB = 12  # Megatron's calls take even shards (no offsets): 12 divides by 1, 2 and 3


def _check_megatron_call():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(EVEN_VOCAB, world, rank)
    X, t = randn((3, 4, EVEN_VOCAB), 40), _targets((3, 4), EVEN_VOCAB, 41)
    ref_x = X.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(
        ref_x.reshape(-1, EVEN_VOCAB), t.reshape(-1), label_smoothing=0.1, reduction="none"
    )
    ref.sum().backward()
    results = []
    # Megatron's call, and the same with the group under Megatron-style and shardkit names
    calls = [
        lambda x: vocab_parallel_cross_entropy(x, t, 0.1),
        lambda x: vocab_parallel_cross_entropy(x, t, 0.1, tp_group=dist.group.WORLD),
        lambda x: vocab_parallel_cross_entropy(x, t, label_smoothing=0.1, group=dist.group.WORLD),
    ]
    for call in calls:
        x = X[..., start:end].clone().requires_grad_()
        out = call(x)
        torch.testing.assert_close(out.reshape(-1), ref.detach())
        out.sum().backward()
        torch.testing.assert_close(x.grad, ref_x.grad.view(X.shape)[..., start:end])
        results.append(True)
    # earlier shardkit code passed the group third: a ProcessGroup there is the group, no smoothing
    x = X[..., start:end]
    plain = torch.nn.functional.cross_entropy(X.reshape(-1, EVEN_VOCAB), t.reshape(-1), reduction="none")
    torch.testing.assert_close(vocab_parallel_cross_entropy(x, t, dist.group.WORLD).reshape(-1), plain)
    with pytest.raises(TypeError, match="not both"):
        vocab_parallel_cross_entropy(x, t, group=dist.group.WORLD, tp_group=dist.group.WORLD)
    with pytest.raises(TypeError, match="both as the third"):
        vocab_parallel_cross_entropy(x, t, dist.group.WORLD, group=dist.group.WORLD)
    # the smoothing must be a number in [0, 1]: anything else fails on every rank, never silently
    with pytest.raises(ValueError):
        vocab_parallel_cross_entropy(x, t, 1.5)
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_megatron_positional_label_smoothing_is_exact(world_size):
    assert run_world(_check_megatron_call, world_size) == [[True] * 3] * world_size


def _check_num_label_tokens():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(EVEN_VOCAB, world, rank)
    X, t = randn((2, 5, EVEN_VOCAB), 42), _targets((2, 5), EVEN_VOCAB, 43)
    t[0, :2] = -100
    summed = torch.nn.functional.cross_entropy(X.reshape(-1, EVEN_VOCAB), t.reshape(-1), reduction="sum")
    loss_fn = TEParallelCrossEntropy(reduction="sum", tp_group=dist.group.WORLD)
    out = loss_fn(X[..., start:end], t, num_label_tokens=24)  # e.g. tokens over 3 micro-batches
    torch.testing.assert_close(out, summed / 24)
    torch.testing.assert_close(loss_fn(X[..., start:end], t, num_label_tokens=torch.tensor(8.0)), summed / 8)
    with pytest.raises(ValueError, match="num_label_tokens"):
        TEParallelCrossEntropy(reduction="mean")(X[..., start:end], t, num_label_tokens=8)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_num_label_tokens_divides_the_summed_loss(world_size):
    assert all(run_world(_check_num_label_tokens, world_size))


def test_te_availability_names():
    from shardkit.losses import HAVE_TE_PARALLEL_CE, MISSING_TE_PARALLEL_CE_MSG

    assert HAVE_TE_PARALLEL_CE is True and isinstance(MISSING_TE_PARALLEL_CE_MSG, str)


def _check_inplace_backward():
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank)
    results = []
    for dtype in (torch.float64, torch.bfloat16):
        rtol, atol = tolerances(dtype)
        X, t = randn((3, 4, VOCAB), 80, dtype), _targets((3, 4), VOCAB, 81)
        t[0, 0] = -100
        opts = dict(vocab_start_index=start, vocab_end_index=end, label_smoothing=0.1, reduction="mean")
        ref_x = X.to(torch.float64, copy=True).requires_grad_()
        reference_cross_entropy(ref_x, t, label_smoothing=0.1, reduction="mean").backward()
        expected = ref_x.grad[..., start:end]
        # a leaf: after backward its storage holds the gradient, which is its .grad
        x = X[..., start:end].contiguous().requires_grad_()
        storage = x.data_ptr()
        vocab_parallel_cross_entropy(x, t, inplace_backward=True, **opts).backward()
        torch.testing.assert_close(x.grad.double(), expected, rtol=rtol, atol=atol)
        assert x.grad.data_ptr() == storage and torch.equal(x.detach(), x.grad)
        # logits from a matmul: the gradients of its inputs are those of the out-of-place backward
        H, W = randn((3, 4, 5), 82, dtype), randn((VOCAB, 5), 83, dtype)
        grads = []
        for inplace in (False, True):
            h, w = H.clone().requires_grad_(), W[start:end].clone().requires_grad_()
            vocab_parallel_cross_entropy(h @ w.t(), t, inplace_backward=inplace, **opts).backward()
            grads.append((h.grad, w.grad))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
        results.append(True)
    with pytest.raises(TypeError, match="inplace_backward"):
        vocab_parallel_cross_entropy(X[..., start:end], t, inplace_backward=1, **opts)
    return results


@pytest.mark.parametrize("world_size", [1, 2])
def test_inplace_backward_reuses_the_logits_storage(world_size):
    assert run_world(_check_inplace_backward, world_size) == [[True, True]] * world_size


def _check_spec_api_uneven_shards():
    # VOCAB = 13 columns split unevenly (array_split): the three specification front ends take this
    # rank's columns as vocab_start_index / vocab_end_index, like vocab_parallel_cross_entropy
    world, rank = dist.get_world_size(), dist.get_rank()
    start, end = vocab_slice(VOCAB, world, rank, even=False)
    X = randn((3, 4, VOCAB), 8, torch.float32)
    t = _targets((3, 4), VOCAB, 9)
    ref_x = X.to(torch.float64, copy=True).requires_grad_()
    ref = reference_cross_entropy(ref_x, t, label_smoothing=0.1, reduction="none")
    ref.sum().backward()
    fronts = {
        "apply": lambda x: CrossEntropyFunction.apply(x, t, 0.1, False, None, -100, start, end),
        "function": lambda x: parallel_cross_entropy(x, t, 0.1, vocab_start_index=start, vocab_end_index=end),
        "module": lambda x: TEParallelCrossEntropy(
            reduction="none", label_smoothing=0.1, vocab_start_index=start, vocab_end_index=end
        )(x, t),
    }
    for name, front in fronts.items():
        x = X[..., start:end].clone().requires_grad_()
        out = front(x)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5, msg=name)
        out.sum().backward()
        torch.testing.assert_close(
            x.grad.double(), ref_x.grad[..., start:end], rtol=1e-5, atol=1e-6, msg=name
        )
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_specification_api_uneven_shards(world_size):
    assert all(run_world(_check_spec_api_uneven_shards, world_size))
