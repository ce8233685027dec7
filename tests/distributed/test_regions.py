"""Region mappings against the single-process computation on the same global tensor.

Every rank builds the same global tensors from fixed seeds, runs the sharded computation, and compares
its forward values and gradients with plain torch on the global tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.autograd import gradcheck, gradgradcheck

from shardkit.distributed import regions
from shardkit.distributed.regions import (
    copy_to_region,
    gather_from_region,
    gather_from_region_local_grad,
    gather_from_region_sum_grad,
    reduce_from_region,
    reduce_scatter_to_region,
    scatter_to_region,
)
from shardkit.distributed.tensor_split import split_sizes
from shardkit.distributed.validation import set_validation, validation_enabled
from shardkit.testing import run_world

WORLD_SIZES = [1, 2, 3, 4]
# (7, 5) splits unevenly at 2, 3, 4 ranks; (2, 3) leaves some ranks an empty chunk at 3 and 4 ranks
SHAPES = [(7, 5), (2, 3)]
DIMS = [0, -1]


def _randn(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _chunk(t, dim, world, rank, sizes=None):
    sizes = sizes or split_sizes(t.size(dim), world)
    return torch.split(t, list(sizes), dim=dim)[rank]


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# one check per mapping; each runs on every rank


def _check_copy(shape, world, rank):
    X, W = _randn(shape, 1), _randn((world, *shape), 2)
    x = X.clone().requires_grad_()
    out = copy_to_region(x)
    assert torch.equal(out, X) and out is not x
    # each rank does its own work with the copy: the gradient is the sum of the ranks' parts
    (out.sin() * W[rank]).sum().backward()
    ref = X.clone().requires_grad_()
    sum((ref.sin() * W[r]).sum() for r in range(world)).backward()
    _close(x.grad, ref.grad)


def _check_reduce(shape, world, rank):
    Xs, C = _randn((world, *shape), 3), _randn(shape, 4)
    x = Xs[rank].clone().requires_grad_()
    before = x.detach().clone()
    out = reduce_from_region(x)
    _close(out, Xs.sum(0))
    assert torch.equal(x.detach(), before), "reduce_from_region modified its input"
    (out.pow(2) * C).sum().backward()
    ref = Xs.clone().requires_grad_()
    (ref.sum(0).pow(2) * C).sum().backward()
    _close(x.grad, ref.grad[rank])


def _check_scatter(shape, dim, world, rank, explicit_sizes):
    X, C = _randn(shape, 5), _randn(shape, 6)
    sizes = list(reversed(split_sizes(X.size(dim), world))) if explicit_sizes else None
    x = X.clone().requires_grad_()
    out = scatter_to_region(x, dim, sizes=sizes)
    assert torch.equal(out, _chunk(X, dim, world, rank, sizes)) and out.is_contiguous()
    (out.pow(2) * _chunk(C, dim, world, rank, sizes)).sum().backward()
    # the scattered input is replicated: its gradient is the whole gradient, on every rank
    _close(x.grad, 2 * X * C)


def _check_gather(shape, dim, world, rank):
    X, C = _randn(shape, 7), _randn(shape, 8)
    x = _chunk(X, dim, world, rank).clone().requires_grad_()
    out = gather_from_region(x, dim)
    assert torch.equal(out, X)
    (out.pow(2) * C).sum().backward()  # the same loss on every rank
    _close(x.grad, _chunk(2 * X * C, dim, world, rank))


def _check_gather_sum_grad(shape, dim, world, rank):
    X, W = _randn(shape, 9), _randn((world, *shape), 10)
    x = _chunk(X, dim, world, rank).clone().requires_grad_()
    out = gather_from_region_sum_grad(x, dim)
    assert torch.equal(out, X)
    (out.pow(2) * W[rank]).sum().backward()  # different work on every rank
    _close(x.grad, _chunk(2 * X * W.sum(0), dim, world, rank))
    # the plain gather keeps only this rank's own contribution
    x_plain = x.detach().clone().requires_grad_()
    (gather_from_region(x_plain, dim).pow(2) * W[rank]).sum().backward()
    _close(x_plain.grad, _chunk(2 * X * W[rank], dim, world, rank))


def _check_reduce_scatter(shape, dim, world, rank, explicit_sizes):
    Xs, C = _randn((world, *shape), 11), _randn(shape, 12)
    total = Xs.sum(0)
    sizes = list(reversed(split_sizes(total.size(dim), world))) if explicit_sizes else None
    x = Xs[rank].clone().requires_grad_()
    out = reduce_scatter_to_region(x, dim, sizes=sizes)
    _close(out, _chunk(total, dim, world, rank, sizes))
    (out.pow(2) * _chunk(C, dim, world, rank, sizes)).sum().backward()
    _close(x.grad, 2 * total * C)


def _all_mappings_match_reference():
    world, rank = dist.get_world_size(), dist.get_rank()
    checked = 0
    try:
        for validate in (True, False):
            set_validation(validate)
            for shape in SHAPES:
                _check_copy(shape, world, rank)
                _check_reduce(shape, world, rank)
                for dim in DIMS:
                    for explicit_sizes in (False, True):
                        _check_scatter(shape, dim, world, rank, explicit_sizes)
                        _check_reduce_scatter(shape, dim, world, rank, explicit_sizes)
                    _check_gather(shape, dim, world, rank)
                    _check_gather_sum_grad(shape, dim, world, rank)
                    checked += 1
    finally:
        set_validation(True)
    return checked


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_mappings_forward_and_backward_match_single_process(world_size):
    assert run_world(_all_mappings_match_reference, world_size) == [8] * world_size


# ---------------------------------------------------------------------------------------------------
# double backward


def _double_backward_matches_reference():
    world, rank = dist.get_world_size(), dist.get_rank()
    for dim in DIMS:
        # gather: y = gather(x) is used identically everywhere; d/dx of a function of dL/dx
        X, C = _randn((7, 5), 13), _randn((7, 5), 14)
        x = _chunk(X, dim, world, rank).clone().requires_grad_()
        (g,) = torch.autograd.grad((gather_from_region(x, dim).pow(3) * C).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
        ref = X.clone().requires_grad_()
        (G,) = torch.autograd.grad((ref.pow(3) * C).sum(), ref, create_graph=True)
        G.pow(2).sum().backward()
        _close(g.detach(), _chunk(G.detach(), dim, world, rank))
        _close(x.grad, _chunk(ref.grad, dim, world, rank))

    # reduce: each rank's x_r is its own variable; M sums a per-rank function of each rank's gradient
    Xs, C, D = _randn((world, 4, 3), 15), _randn((4, 3), 16), _randn((world, 4, 3), 17)
    x = Xs[rank].clone().requires_grad_()
    (g,) = torch.autograd.grad((reduce_from_region(x).pow(3) * C).sum(), x, create_graph=True)
    (g.pow(2) * D[rank]).sum().backward()
    ref = Xs.clone().requires_grad_()
    (G,) = torch.autograd.grad((ref.sum(0).pow(3) * C).sum(), ref, create_graph=True)
    (G.pow(2) * D).sum().backward()
    _close(g.detach(), G.detach()[rank])
    _close(x.grad, ref.grad[rank])
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_double_backward_through_gather_and_reduce(world_size):
    assert all(run_world(_double_backward_matches_reference, world_size))


# ---------------------------------------------------------------------------------------------------
# double-backward audit: every mapping, second-order terms that couple the chunks and the ranks
#
# E_r (first-order loss) and P_r (second-order loss of a gradient) are smooth functions whose Hessians
# couple every entry, so a double backward that keeps only a rank's own chunk, or only its own term,
# shows. The references are single-process graphs on the global tensors: replicated tensors are one
# tensor (the logical contract of the module doc), each rank's terms are summed. The per-rank gather
# is checked against per-rank graphs in which the other ranks' chunks are constants.


def _E(y, w):
    """A first-order loss whose Hessian couples all entries of ``y`` (``w``: per-rank weights)."""
    return (y.sin() * w).sum() ** 2 + (y.pow(2) * w).sum() * y.sum()


def _P(g, d):
    """A second-order loss of a gradient ``g``, non-linear so that its own gradient depends on ``g``."""
    return (g.pow(2) * d).sum() + g.sum() ** 2 * d.mean()


def _first_and_second(x, loss_of):
    """``(F, H)``: ``F = dE/dx`` with a graph, ``H = dP/dx`` for the losses given by ``loss_of``."""
    E, P_of = loss_of
    (F,) = torch.autograd.grad(E(x), x, create_graph=True)
    (H,) = torch.autograd.grad(P_of(F), x)
    return F.detach(), H


def _double_backward_audit(dim):
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = (5, 4)  # uneven along both dims at 2 and 3 ranks
    W, D = _randn((world, *shape), 30), _randn((world, *shape), 31)
    X = _randn(shape, 32)
    Xs = _randn((world, *shape), 33)
    checked = []

    def leaf(t):
        return t.clone().requires_grad_()

    # copy: replicated input used for different work by each rank (gradient summed over ranks); the
    # replicated gradient is then used identically (P with one weight), as the contract asks
    F, H = _first_and_second(leaf(X), (lambda x: _E(copy_to_region(x), W[rank]), lambda g: _P(g, D[0])))
    ref = leaf(X)
    RF, RH = _first_and_second(ref, (lambda x: sum(_E(x, W[r]) for r in range(world)), lambda g: _P(g, D[0])))
    _close(F, RF), _close(H, RH)
    checked.append("copy")

    # reduce: each rank's x_r is its own variable; the sum is used identically; each rank's gradient
    # is its own tensor, so each rank's second-order loss is its own
    F, H = _first_and_second(
        leaf(Xs[rank]), (lambda x: _E(reduce_from_region(x), W[0]), lambda g: _P(g, D[rank]))
    )
    RF, RH = _first_and_second(
        leaf(Xs), (lambda x: _E(x.sum(0), W[0]), lambda g: sum(_P(g[r], D[r]) for r in range(world)))
    )
    _close(F, RF[rank]), _close(H, RH[rank])
    checked.append("reduce")

    # scatter: each rank works on its own chunk; the replicated gradient is used identically
    F, H = _first_and_second(
        leaf(X),
        (lambda x: _E(scatter_to_region(x, dim), _chunk(W[rank], dim, world, rank)), lambda g: _P(g, D[0])),
    )
    RF, RH = _first_and_second(
        leaf(X),
        (
            lambda x: sum(_E(_chunk(x, dim, world, r), _chunk(W[r], dim, world, r)) for r in range(world)),
            lambda g: _P(g, D[0]),
        ),
    )
    _close(F, RF), _close(H, RH)
    checked.append("scatter")

    # gather: the gathered tensor is used identically; each rank's gradient chunk is its own
    x_r = _chunk(X, dim, world, rank)
    F, H = _first_and_second(
        leaf(x_r),
        (lambda x: _E(gather_from_region(x, dim), W[0]), lambda g: _P(g, _chunk(D[rank], dim, world, rank))),
    )
    RF, RH = _first_and_second(
        leaf(X),
        (
            lambda x: _E(x, W[0]),
            lambda g: sum(_P(_chunk(g, dim, world, r), _chunk(D[r], dim, world, r)) for r in range(world)),
        ),
    )
    _close(F, _chunk(RF, dim, world, rank)), _close(H, _chunk(RH, dim, world, rank))
    checked.append("gather")

    # sum-grad gather: different work on every rank, each rank's second-order loss its own
    F, H = _first_and_second(
        leaf(x_r),
        (
            lambda x: _E(gather_from_region_sum_grad(x, dim), W[rank]),
            lambda g: _P(g, _chunk(D[rank], dim, world, rank)),
        ),
    )
    RF, RH = _first_and_second(
        leaf(X),
        (
            lambda x: sum(_E(x, W[r]) for r in range(world)),
            lambda g: sum(_P(_chunk(g, dim, world, r), _chunk(D[r], dim, world, r)) for r in range(world)),
        ),
    )
    _close(F, _chunk(RF, dim, world, rank)), _close(H, _chunk(RH, dim, world, rank))
    checked.append("gather_sum_grad")

    # reduce-scatter: each rank's x_r is its own variable, each rank works on its chunk of the sum
    F, H = _first_and_second(
        leaf(Xs[rank]),
        (
            lambda x: _E(reduce_scatter_to_region(x, dim), _chunk(W[rank], dim, world, rank)),
            lambda g: _P(g, D[rank]),
        ),
    )
    RF, RH = _first_and_second(
        leaf(Xs),
        (
            lambda x: sum(
                _E(_chunk(x.sum(0), dim, world, r), _chunk(W[r], dim, world, r)) for r in range(world)
            ),
            lambda g: sum(_P(g[r], D[r]) for r in range(world)),
        ),
    )
    _close(F, RF[rank]), _close(H, RH[rank])
    checked.append("reduce_scatter")

    # local-grad gather: per-rank contract, different work on every rank; rank r's reference graph
    # holds the other ranks' chunks as constants
    F, H = _first_and_second(
        leaf(x_r),
        (
            lambda x: _E(gather_from_region_local_grad(x, dim), W[rank]),
            lambda g: _P(g, _chunk(D[rank], dim, world, rank)),
        ),
    )
    pieces = [_chunk(X, dim, world, r) for r in range(world)]

    def own_graph(x):
        return _E(torch.cat(pieces[:rank] + [x] + pieces[rank + 1 :], dim=dim), W[rank])

    RF, RH = _first_and_second(leaf(x_r), (own_graph, lambda g: _P(g, _chunk(D[rank], dim, world, rank))))
    _close(F, RF), _close(H, RH)
    checked.append("gather_local_grad")
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dim", DIMS)
def test_double_backward_audit_of_every_mapping(world_size, dim):
    expected = [
        "copy",
        "reduce",
        "scatter",
        "gather",
        "gather_sum_grad",
        "reduce_scatter",
        "gather_local_grad",
    ]
    assert run_world(_double_backward_audit, world_size, dim) == [expected] * world_size


def _gather_contracts_on_the_issue_example():
    """x_r = [r + 2], E_r = (prod(gathered) + r + 1) ** 2: the two gathers differ at second order only."""
    rank = dist.get_rank()
    results = {}
    for name, gather in (("local", gather_from_region_local_grad), ("logical", gather_from_region)):
        x = torch.tensor([rank + 2.0], dtype=torch.float64, requires_grad=True)
        energy = (gather(x, 0).prod() + rank + 1) ** 2
        (force,) = torch.autograd.grad(energy, x, create_graph=True)
        (hess,) = torch.autograd.grad(force, x)
        results[name] = (force.item(), hess.item())
    return results


def _gather_expanded_gradient():
    # a gradient expanded from a scalar has stride 0 on a size-1 dim: the byte view must not reject it
    rank = dist.get_rank()
    x = torch.tensor(float(rank + 1)).expand(1)
    assert x.stride() == (0,)
    return [gather_from_region(x, 0).tolist(), gather_from_region_sum_grad(x, 0).tolist()]


def test_gather_of_an_expanded_tensor():
    assert run_world(_gather_expanded_gradient, 2) == [[[1.0, 2.0], [1.0, 2.0]]] * 2


def test_local_and_logical_gather_on_a_per_rank_loss():
    # per rank with the other chunk constant: F_0 = 2(x0 x1 + 1) x1 = 42, dF_0/dx0 = 2 x1^2 = 18;
    # F_1 = 2(x0 x1 + 2) x0 = 32, dF_1/dx1 = 2 x0^2 = 8
    by_rank = run_world(_gather_contracts_on_the_issue_example, 2)
    assert [r["local"] for r in by_rank] == [pytest.approx((42.0, 18.0)), pytest.approx((32.0, 8.0))]
    # the logical gather's second order assumes the gathered tensor is used identically, which a
    # per-rank loss is not: the other rank's second-order term comes in (18 + 26, 8 + 28)
    assert [r["logical"] for r in by_rank] == [pytest.approx((42.0, 44.0)), pytest.approx((32.0, 36.0))]


# ---------------------------------------------------------------------------------------------------
# gradcheck / gradgradcheck
#
# gradcheck perturbs one input element at a time, on every rank in lockstep. So each function takes the
# replicated global tensor (every rank perturbs the same element, and calls the collectives the same
# number of times) and returns a replicated tensor, with the mapping under test inside.


def _composites(world, rank):
    W = _randn((world, 3, 2), 18)

    def scatter_gather(X, dim):
        return gather_from_region(scatter_to_region(X, dim).pow(3), dim)

    def copy_reduce(X, dim):
        return reduce_from_region(copy_to_region(X).pow(3) * W[rank])

    def sum_grad_gather(X, dim):
        return reduce_from_region(
            gather_from_region_sum_grad(scatter_to_region(X, dim), dim).pow(3) * W[rank]
        )

    def reduce_scatter(X, dim):
        return gather_from_region(reduce_scatter_to_region(copy_to_region(X).pow(3) * W[rank], dim), dim)

    return [scatter_gather, copy_reduce, sum_grad_gather, reduce_scatter]


def _gradchecks_pass():
    world, rank = dist.get_world_size(), dist.get_rank()
    # (3, 2) leaves a rank an empty chunk along dim -1 at 3 ranks
    X = _randn((3, 2), 19).requires_grad_()
    for fn in _composites(world, rank):
        for dim in DIMS:
            assert gradcheck(lambda t, fn=fn, dim=dim: fn(t, dim), (X,), eps=1e-6, atol=1e-7)
        torch.manual_seed(20)  # gradgradcheck draws grad_outputs: they must be replicated too
        assert gradgradcheck(lambda t, fn=fn: fn(t, 0), (X,), eps=1e-6, atol=1e-7)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gradcheck_float64(world_size):
    assert all(run_world(_gradchecks_pass, world_size))


# ---------------------------------------------------------------------------------------------------
# dtypes, groups, validation


def _close_fp32(a, b):
    torch.testing.assert_close(a, b)
    return True


def _dtypes_are_kept():
    world, rank = dist.get_world_size(), dist.get_rank()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        # fp16 / bf16 are summed in fp32 and rounded once: exactly the single-process sum of a few such
        # values; fp32 sums may differ in the order of additions
        check = torch.equal if dtype != torch.float32 else _close_fp32
        Xs = _randn((world, 5, 3), 21).to(dtype)
        out = reduce_from_region(Xs[rank])
        assert out.dtype == dtype and check(out, Xs.float().sum(0).to(dtype))
        out = reduce_scatter_to_region(Xs[rank], 0)
        assert out.dtype == dtype and check(out, _chunk(Xs.float().sum(0).to(dtype), 0, world, rank))
        X = _randn((5, 3), 22).to(dtype)
        for dim in DIMS:
            out = gather_from_region(_chunk(X, dim, world, rank), dim)
            assert out.dtype == dtype and torch.equal(out, X)
    for dtype in (torch.int64, torch.int16, torch.uint8, torch.bool, torch.complex64):
        values = torch.arange(15).reshape(5, 3).to(dtype)
        for dim in DIMS:
            assert torch.equal(gather_from_region(_chunk(values, dim, world, rank), dim), values)
        if dtype != torch.bool:
            summed = reduce_from_region(values)
            assert summed.dtype == dtype and torch.equal(summed, values * world)
    return True


def test_dtypes_are_kept():
    assert all(run_world(_dtypes_are_kept, 3))


def _subgroups():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    singles = [dist.new_group([r]) for r in range(4)]
    pair, pair_rank = pairs[rank // 2], rank % 2
    X = _randn((5, 3), 23)
    x = _chunk(X, 0, 2, pair_rank).clone().requires_grad_()
    out = gather_from_region(x, 0, group=pair)
    assert torch.equal(out, X)
    (out * X).sum().backward()
    assert torch.equal(x.grad, _chunk(X, 0, 2, pair_rank))
    summed = reduce_from_region(torch.full((2,), float(rank)), group=pair)
    assert summed.tolist() == [float(sum(range(rank // 2 * 2, rank // 2 * 2 + 2)))] * 2
    # a group of one rank: the identity, no communication
    alone = singles[rank]
    assert torch.equal(gather_from_region(X, 0, group=alone), X)
    assert torch.equal(reduce_from_region(X, group=alone), X)
    assert torch.equal(scatter_to_region(X, 0, group=alone), X)
    # a group this rank is not in
    with pytest.raises(ValueError, match="not a member"):
        gather_from_region(X, 0, group=pairs[1 - rank // 2])
    return True


def test_subgroups_and_groups_of_one():
    assert all(run_world(_subgroups, 4))


def _mismatches_raise_everywhere():
    rank = dist.get_rank()
    messages = {}
    # non-split dimension differs on rank 1
    with pytest.raises(ValueError) as info:
        gather_from_region(torch.zeros(2, 3 + (rank == 1)), 0)
    messages["gather other dims"] = str(info.value)
    # number of dimensions differs on rank 1
    with pytest.raises(ValueError) as info:
        gather_from_region_sum_grad(torch.zeros((2, 3, 1) if rank == 1 else (2, 3)), 0)
    messages["gather ndim"] = str(info.value)
    # all-reduce based mappings with shapes that cannot be summed
    with pytest.raises(ValueError) as info:
        reduce_from_region(torch.zeros(2 + (rank == 1), 3))
    messages["reduce"] = str(info.value)
    with pytest.raises(ValueError) as info:
        reduce_scatter_to_region(torch.zeros(2, 3 + rank), 0)
    messages["reduce_scatter"] = str(info.value)
    # the backward of copy is an all-reduce: a mismatch surfaces there, on every rank
    x = torch.zeros(2 + (rank == 1), requires_grad=True)
    with pytest.raises(ValueError) as info:
        copy_to_region(x).sum().backward()
    messages["copy backward"] = str(info.value)
    # the sizes of an explicit scatter are checked locally
    with pytest.raises(ValueError) as info:
        scatter_to_region(torch.zeros(4, 2), 0, sizes=[4])
    messages["scatter count"] = str(info.value)
    with pytest.raises(ValueError) as info:
        scatter_to_region(torch.zeros(4, 2), 0, sizes=[1, 1, 1])
    messages["scatter sum"] = str(info.value)
    # the group still works after all of that
    assert reduce_from_region(torch.ones(1)).item() == dist.get_world_size()
    return messages


def test_mismatched_shapes_raise_on_every_rank():
    results = run_world(_mismatches_raise_everywhere, 3, timeout=60)
    collective = ["gather other dims", "gather ndim", "reduce", "reduce_scatter", "copy backward"]
    for rank, messages in enumerate(results):
        # checks made on exchanged shapes: the same verdict, word for word, on every rank
        assert [messages[k] for k in collective] == [results[0][k] for k in collective]
        # checks of local arguments name the rank that made them
        assert (
            f"on rank {rank}:" in messages["scatter count"] and f"on rank {rank}:" in messages["scatter sum"]
        )
    m = results[0]
    assert "rank 0: (2, 3), rank 1: (2, 4), rank 2: (2, 3)" in m["gather other dims"]
    assert "rank 1: (2, 3, 1)" in m["gather ndim"] and "numbers of dimensions" in m["gather ndim"]
    assert "rank 1: (3, 3)" in m["reduce"]
    assert "rank 2: (2, 5)" in m["reduce_scatter"]
    assert "rank 1: (3,)" in m["copy backward"]
    assert "1 sizes" in m["scatter count"] and "3 ranks" in m["scatter count"]
    assert "sum to 3" in m["scatter sum"] and "size 4" in m["scatter sum"]


def _validation_switch_skips_the_shape_exchange():
    calls = []
    original = regions.gather_shapes

    def counting(tensor, group=None, dim=None):
        calls.append(tuple(tensor.shape))
        return original(tensor, group, dim)

    regions.gather_shapes = counting
    try:
        x = torch.ones(4, 2)
        assert validation_enabled()
        reduce_from_region(x)
        reduce_scatter_to_region(x, 0)
        on = len(calls)
        set_validation(False)
        reduce_from_region(x)
        reduce_scatter_to_region(x, 0)
        off_reduce = len(calls) - on
        # a gather needs the sizes, so it always exchanges shapes ...
        y = scatter_to_region(x.clone().requires_grad_(), 0)
        gather_from_region(y, 0)
        gathered = len(calls) - on - off_reduce
        # ... except in the backward of a scatter, which knows them from its forward
        y.sum().backward()
        backward = len(calls) - on - off_reduce - gathered
    finally:
        regions.gather_shapes = original
        set_validation(True)
    return on, off_reduce, gathered, backward


def test_validation_switch():
    assert run_world(_validation_switch_skips_the_shape_exchange, 2) == [(2, 0, 1, 0)] * 2


def test_validation_env_var(monkeypatch):
    from shardkit.distributed import validation

    try:
        for value, expected in [("0", False), ("off", False), ("1", True), ("", True)]:
            monkeypatch.setenv("SHARDKIT_VALIDATE", value)
            validation._reset_to_default()
            assert validation_enabled() is expected
        with pytest.raises(TypeError):
            set_validation("no")
    finally:
        monkeypatch.undo()
        validation._reset_to_default()


def test_identity_without_torch_distributed():
    assert not dist.is_initialized()  # the pytest process itself never initializes a default group
    X = _randn((5, 3), 24)
    for fn in (
        copy_to_region,
        reduce_from_region,
        lambda t: scatter_to_region(t, 0),
        lambda t: gather_from_region(t, -1),
        lambda t: gather_from_region_sum_grad(t, 0),
        lambda t: reduce_scatter_to_region(t, -1),
    ):
        x = X.clone().requires_grad_()
        out = fn(x)
        assert torch.equal(out, X)
        (out * 2).sum().backward()
        assert torch.equal(x.grad, torch.full_like(X, 2.0))
    with pytest.raises(ValueError):
        scatter_to_region(X, 0, sizes=[2, 3])
    assert torch.equal(scatter_to_region(X, 0, sizes=[5]), X)


def _dtype_and_dim_disagreements():
    rank = dist.get_rank()
    messages = {}
    x = torch.ones(2, 2, dtype=torch.float64 if rank == 1 else torch.float32)
    with pytest.raises(ValueError) as info:
        gather_from_region(x, dim=0)
    messages["dtype"] = str(info.value)
    y = torch.ones(2, 2)
    with pytest.raises(ValueError) as info:
        gather_from_region(y, dim=1 if rank == 1 else 0)
    messages["dim"] = str(info.value)
    # -1 and ndim - 1 are the same dim and must agree
    assert gather_from_region(y, dim=-1 if rank == 0 else 1).shape == (2, 2 * dist.get_world_size())
    return messages


def test_dtype_or_dim_disagreement_fails_on_every_rank():
    for messages in run_world(_dtype_and_dim_disagreements, 3, timeout=60):
        assert "different dtypes" in messages["dtype"] and "rank 1: torch.float64" in messages["dtype"]
        assert "different dims" in messages["dim"] and "rank 1: 1" in messages["dim"]
