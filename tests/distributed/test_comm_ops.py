"""Comm ops against the single-process computation on the same global data.

Every rank builds all ranks' inputs from fixed seeds, runs the op on its own inputs, and compares the
output with plain torch on the global data. For gradients, rank ``r`` weights each of its outputs by a
fixed random tensor; the reference sums every rank's weighted outputs and differentiates that one
loss with respect to every rank's inputs, so rank ``r``'s input gradient must equal the reference's
(divided by the world size when gradient division is on).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed.awaitable import Awaitable
from shardkit.distributed.codecs import QuantizedCommCodecs, make_codec
from shardkit.distributed.comm_ops import (
    all_gather_base_pooled,
    alltoall_pooled,
    alltoall_sequence,
    alltoallv,
    get_gradient_division,
    reduce_scatter_base_pooled,
    reduce_scatter_pooled,
    reduce_scatter_v_per_feature_pooled,
    reduce_scatter_v_pooled,
    set_gradient_division,
    variable_batch_alltoall_pooled,
)
from shardkit.distributed.state import reset_all
from shardkit.distributed.tensor_split import split_offsets, split_sizes
from shardkit.distributed.validation import set_validation
from shardkit.testing import run_world

WORLD_SIZES = [1, 2, 3, 4]
# uneven per-rank batch sizes, rank 2's empty (from 3 ranks on)
BATCH = [2, 3, 0, 4]
FEATURE_DIMS = [[2, 3], [1], [4, 2], [3]]  # embedding dims of each rank's local features


def _randn(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _randint(high, shape, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _rows(t, sizes, index):
    return t.narrow(0, split_offsets(sizes)[index], sizes[index])


@dataclasses.dataclass
class Case:
    """One op under test.

    ``inputs(world)``: every rank's input tensors; ``call(rank, world, inputs, codecs, group)``: the op on
    one rank; ``reference(rank, all_inputs)``: that rank's outputs computed with plain torch.
    """

    name: str
    inputs: Callable[[int], list]
    call: Callable[..., Awaitable]
    reference: Callable[[int, list], tuple]


# ---------------------------------------------------------------------------------------------------
# the cases


def _pooled_case() -> Case:
    def inputs(world):
        return [(_randn((sum(BATCH[:world]), 1 + s), 100 + s),) for s in range(world)]

    def call(rank, world, xs, codecs, group):
        dims = [1 + s for s in range(world)]
        return alltoall_pooled(xs[0], BATCH[:world], dims, codecs=codecs, group=group)

    def reference(rank, all_inputs):
        world = len(all_inputs)
        return (_rows(torch.cat([x for (x,) in all_inputs], dim=1), BATCH[:world], rank),)

    return Case("alltoall_pooled", inputs, call, reference)


def _variable_batch_setup(world):
    """batch[r][g]: rank r's batch size of global feature g; features (s, f) in rank order."""
    features = [(s, f) for s in range(world) for f in range(len(FEATURE_DIMS[s]))]
    batch = _randint(4, (world, len(features)), 110).tolist()
    return features, batch


def _variable_batch_case() -> Case:
    def block_sizes(world, s):
        """Elements of rank s's input for each destination rank r."""
        features, batch = _variable_batch_setup(world)
        own = [g for g, (owner, _) in enumerate(features) if owner == s]
        return [sum(batch[r][g] * FEATURE_DIMS[s][features[g][1]] for g in own) for r in range(world)]

    def inputs(world):
        return [(_randn(sum(block_sizes(world, s)), 120 + s),) for s in range(world)]

    def call(rank, world, xs, codecs, group):
        features, batch = _variable_batch_setup(world)
        own = [g for g, (owner, _) in enumerate(features) if owner == rank]
        per_rank_per_feature = [[batch[r][g] for g in own] for r in range(world)]
        return variable_batch_alltoall_pooled(
            xs[0], per_rank_per_feature, batch[rank], FEATURE_DIMS[:world], codecs=codecs, group=group
        )

    def reference(rank, all_inputs):
        world = len(all_inputs)
        return (torch.cat([_rows(x, block_sizes(world, s), rank) for s, (x,) in enumerate(all_inputs)]),)

    return Case("variable_batch_alltoall_pooled", inputs, call, reference)


SEQ_FEATURES, SEQ_DIM = 2, 3


def _sequence_setup(world, variable):
    """lengths[s][f][r]: ids of rank r's samples for feature f of rank s (a [B_r] tensor)."""
    batch = BATCH[:world] if variable else [2] * world
    lengths = [
        [
            [_randint(3, (batch[r],), 130 + 100 * s + 10 * f + r) for r in range(world)]
            for f in range(SEQ_FEATURES)
        ]
        for s in range(world)
    ]
    return batch, lengths


def _sequence_recat(world, batch, variable):
    """Forward / backward recat from feature-major (f, r) to rank-major (r, f) order of the segments."""
    if not variable:
        forward = [f * world + r for r in range(world) for f in range(SEQ_FEATURES)]
    else:
        # one segment per length entry, at flat position (f, r, b) of the feature-major layout
        starts = split_offsets([batch[r] for _ in range(SEQ_FEATURES) for r in range(world)])
        forward = [
            starts[f * world + r] + b
            for r in range(world)
            for f in range(SEQ_FEATURES)
            for b in range(batch[r])
        ]
    forward = torch.tensor(forward)
    return forward, torch.argsort(forward)


def _segment_rows(lengths_s, world):
    """Rows of each (f, r) segment of owner s's feature-major embeddings."""
    return [int(lengths_s[f][r].sum()) for f in range(SEQ_FEATURES) for r in range(world)]


def _sequence_case(variable: bool) -> Case:
    def inputs(world):
        _, lengths = _sequence_setup(world, variable)
        return [(_randn((sum(_segment_rows(lengths[s], world)), SEQ_DIM), 140 + s),) for s in range(world)]

    def call(rank, world, xs, codecs, group):
        batch, lengths = _sequence_setup(world, variable)
        forward, backward = _sequence_recat(world, batch, variable)
        after = torch.cat([lengths[rank][f][r] for f in range(SEQ_FEATURES) for r in range(world)])
        ids = [
            [int(sum(lengths[s][f][r].sum() for f in range(SEQ_FEATURES))) for r in range(world)]
            for s in range(world)
        ]
        sent = [ids[s][rank] for s in range(world)]  # ids this rank sent to owner s
        received = ids[rank]  # ids owner `rank` received from each rank
        return alltoall_sequence(
            xs[0], forward, backward, after, sent, received, variable, group=group, codecs=codecs
        )

    def reference(rank, all_inputs):
        world = len(all_inputs)
        _, lengths = _sequence_setup(world, variable)
        pieces = []
        for s, (x,) in enumerate(all_inputs):
            rows = _segment_rows(lengths[s], world)
            pieces += [_rows(x, rows, f * world + rank) for f in range(SEQ_FEATURES)]
        return (torch.cat(pieces),)

    return Case(f"alltoall_sequence(variable_batch_size={variable})", inputs, call, reference)


def _alltoallv_case(equal_dims: bool) -> Case:
    def dims(s):
        return [2] * len(FEATURE_DIMS[s]) if equal_dims else FEATURE_DIMS[s]

    def inputs(world):
        return [tuple(_randn((5, d), 150 + 10 * s + i) for i, d in enumerate(dims(s))) for s in range(world)]

    def call(rank, world, xs, codecs, group):
        if equal_dims:
            return alltoallv(
                list(xs),
                per_rank_split_lengths=[len(dims(s)) for s in range(world)],
                codecs=codecs,
                group=group,
            )
        return alltoallv(list(xs), out_split=[sum(dims(s)) for s in range(world)], codecs=codecs, group=group)

    def reference(rank, all_inputs):
        world = len(all_inputs)
        return tuple(_rows(torch.cat(xs, dim=1), split_sizes(5, world), rank) for xs in all_inputs)

    return Case(f"alltoallv(equal_dims={equal_dims})", inputs, call, reference)


def _reduce_scatter_pooled_case() -> Case:
    def inputs(world):
        return [tuple(_randn((r + 1, 2), 160 + 10 * s + r) for r in range(world)) for s in range(world)]

    def call(rank, world, xs, codecs, group):
        return reduce_scatter_pooled(list(xs), codecs=codecs, group=group)

    def reference(rank, all_inputs):
        return (sum(xs[rank] for xs in all_inputs),)

    return Case("reduce_scatter_pooled", inputs, call, reference)


def _reduce_scatter_base_case() -> Case:
    def inputs(world):
        return [(_randn((2 * world, 3), 170 + s),) for s in range(world)]

    def call(rank, world, xs, codecs, group):
        return reduce_scatter_base_pooled(xs[0], codecs=codecs, group=group)

    def reference(rank, all_inputs):
        return (sum(_rows(x, [2] * len(all_inputs), rank) for (x,) in all_inputs),)

    return Case("reduce_scatter_base_pooled", inputs, call, reference)


def _reduce_scatter_v_case() -> Case:
    def inputs(world):
        return [(_randn((sum(BATCH[:world]), 3), 180 + s),) for s in range(world)]

    def call(rank, world, xs, codecs, group):
        return reduce_scatter_v_pooled(xs[0], BATCH[:world], codecs=codecs, group=group)

    def reference(rank, all_inputs):
        return (sum(_rows(x, BATCH[: len(all_inputs)], rank) for (x,) in all_inputs),)

    return Case("reduce_scatter_v_pooled", inputs, call, reference)


PER_FEATURE_DIMS = [2, 3]


def _per_feature_splits(world):
    batch = _randint(4, (world, len(PER_FEATURE_DIMS)), 190).tolist()
    return batch, [sum(b * d for b, d in zip(batch[r], PER_FEATURE_DIMS)) for r in range(world)]


def _reduce_scatter_per_feature_case() -> Case:
    def inputs(world):
        return [(_randn(sum(_per_feature_splits(world)[1]), 195 + s),) for s in range(world)]

    def call(rank, world, xs, codecs, group):
        batch, _ = _per_feature_splits(world)
        return reduce_scatter_v_per_feature_pooled(xs[0], batch, PER_FEATURE_DIMS, codecs=codecs, group=group)

    def reference(rank, all_inputs):
        _, splits = _per_feature_splits(len(all_inputs))
        return (sum(_rows(x, splits, rank) for (x,) in all_inputs),)

    return Case("reduce_scatter_v_per_feature_pooled", inputs, call, reference)


def _all_gather_case() -> Case:
    def inputs(world):
        return [(_randn((2, 3), 200 + s),) for s in range(world)]

    def call(rank, world, xs, codecs, group):
        return all_gather_base_pooled(xs[0], codecs=codecs, group=group)

    def reference(rank, all_inputs):
        return (torch.cat([x for (x,) in all_inputs]),)

    return Case("all_gather_base_pooled", inputs, call, reference)


def _cases() -> list[Case]:
    return [
        _pooled_case(),
        _variable_batch_case(),
        _sequence_case(variable=False),
        _sequence_case(variable=True),
        _alltoallv_case(equal_dims=False),
        _alltoallv_case(equal_dims=True),
        _reduce_scatter_pooled_case(),
        _reduce_scatter_base_case(),
        _reduce_scatter_v_case(),
        _reduce_scatter_per_feature_case(),
        _all_gather_case(),
    ]


# ---------------------------------------------------------------------------------------------------
# running a case


def _weights(rank, shapes, dtype):
    return [_randn(shape, 1000 + 10 * rank + i, dtype) for i, shape in enumerate(shapes)]


def _as_tuple(outputs):
    return tuple(outputs) if isinstance(outputs, (list, tuple)) else (outputs,)


def _reference_grads(case, all_inputs, dtype):
    """Every rank's input gradients of the sum of every rank's weighted outputs, in float64."""
    leaves = [[x.to(torch.float64).requires_grad_() for x in xs] for xs in all_inputs]
    total = 0
    for r in range(len(leaves)):
        refs = case.reference(r, leaves)
        weights = _weights(r, [ref.shape for ref in refs], dtype)
        total = total + sum((ref * w.to(torch.float64)).sum() for ref, w in zip(refs, weights))
    total.backward()
    return [[x.grad for x in xs] for xs in leaves]


def _run_case(case, world, rank, dtype=torch.float64, codecs=None, group=None):
    """The op's outputs and input gradients on this rank, and the float64 references for both."""
    all_inputs = [[x.to(dtype) for x in xs] for xs in case.inputs(world)]
    mine = [x.clone().requires_grad_() for x in all_inputs[rank]]
    request = case.call(rank, world, mine, codecs, group)
    assert isinstance(request, Awaitable)
    outputs = _as_tuple(request.wait())
    assert _as_tuple(request.wait())[0] is outputs[0]  # a second wait returns the same result
    sum(
        (out * w).sum() for out, w in zip(outputs, _weights(rank, [o.shape for o in outputs], dtype))
    ).backward()
    refs = case.reference(rank, [[x.to(torch.float64) for x in xs] for xs in all_inputs])
    ref_grads = _reference_grads(case, all_inputs, dtype)[rank]
    scale = world if get_gradient_division() else 1
    return outputs, [x.grad for x in mine], refs, [g / scale for g in ref_grads]


def _all_ops_match_reference(subgroup_size=None):
    """Every case, gradient division on and off; on groups of ``subgroup_size`` consecutive ranks if given."""
    world, rank, group = dist.get_world_size(), dist.get_rank(), None
    if subgroup_size is not None:
        groups = [
            dist.new_group(list(range(start, start + subgroup_size)))
            for start in range(0, world, subgroup_size)
        ]
        world, rank, group = subgroup_size, rank % subgroup_size, groups[rank // subgroup_size]
    checked = []
    # the second round also runs without cross-rank validation (the ops then trust their arguments)
    for divide, validate in ((True, True), (False, False)):
        set_gradient_division(divide)
        set_validation(validate)
        for case in _cases():
            outputs, grads, refs, ref_grads = _run_case(case, world, rank, group=group)
            assert len(outputs) == len(refs), case.name
            for out, ref in zip(outputs, refs):
                assert out.dtype == torch.float64 and out.shape == ref.shape, case.name
                torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12, msg=case.name)
            for grad, ref in zip(grads, ref_grads):
                torch.testing.assert_close(grad, ref, rtol=1e-12, atol=1e-12, msg=case.name)
            checked.append(case.name)
    set_validation(True)
    return len(checked)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ops_forward_and_backward_match_single_process(world_size):
    assert run_world(_all_ops_match_reference, world_size) == [2 * len(_cases())] * world_size


def test_ops_on_subgroups():
    # two groups of two ranks run every op at the same time, each on its own data
    assert run_world(_all_ops_match_reference, 4, 2) == [2 * len(_cases())] * 4


# ---------------------------------------------------------------------------------------------------
# codecs: forward and backward precision chosen separately

# round-to-nearest relative error of one encode/decode (see shardkit.distributed.codecs)
EPS = {"fp32": 1e-6, "fp16": 2.0**-11, "bf16": 2.0**-8, "fp8": 2.0**-4}
CODEC_PAIRS = [("fp16", "bf16"), ("bf16", "fp16"), ("fp8", "fp16"), ("fp32", "fp8")]


def _check_close_to(actual, expected, eps, scale, world, what):
    # each output element is at most a sum of `world` encoded terms of magnitude <= scale
    torch.testing.assert_close(
        actual.to(torch.float64), expected, rtol=eps, atol=eps * world * scale + 1e-5, msg=what
    )


def _codecs_match_fp32():
    world, rank = dist.get_world_size(), dist.get_rank()
    changed = set()
    for (fwd, bwd), case in itertools.product(CODEC_PAIRS, _cases()):
        codecs = QuantizedCommCodecs(forward=make_codec(fwd), backward=make_codec(bwd))
        outputs, grads, refs, ref_grads = _run_case(case, world, rank, torch.float32, codecs)
        # magnitude bound of what is encoded: the inputs, and the weights (standard normal, below 4
        # for these seeds) that come back as gradients
        scale = max(x.abs().max().item() for xs in case.inputs(world) for x in xs if x.numel()) + 4.0
        for out, ref in zip(outputs, refs):
            assert out.dtype == torch.float32
            _check_close_to(out, ref, EPS[fwd], scale, world, f"{case.name} forward {fwd}")
            if fwd != "fp32" and not torch.equal(out.to(torch.float64), ref):
                changed.add(fwd)
        for grad, ref in zip(grads, ref_grads):
            _check_close_to(grad, ref, EPS[bwd], scale, world, f"{case.name} backward {bwd}")
    return sorted(changed)


@pytest.mark.parametrize("world_size", [1, 3])
def test_codecs_match_fp32_within_their_precision(world_size):
    # every lossy forward codec changed some output, so the codec was really applied
    assert run_world(_codecs_match_fp32, world_size) == [["bf16", "fp16", "fp8"]] * world_size


def _half_precision_without_codec():
    """fp16 / bf16 data without a codec: moved as is, summed in fp32, rounded once (not at every step)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for dtype in (torch.float16, torch.bfloat16):
        xs = [_randn((2 * world, 3), 210 + s).to(dtype) for s in range(world)]
        out = reduce_scatter_base_pooled(xs[rank]).wait()
        expected = _rows(torch.stack(xs).float().sum(0).to(dtype), [2] * world, rank)
        assert out.dtype == dtype and torch.equal(out, expected)
        pooled = alltoall_pooled(_randn((world, 2), 220 + rank).to(dtype), [1] * world, [2] * world).wait()
        assert torch.equal(
            pooled,
            torch.cat([_randn((world, 2), 220 + s).to(dtype)[rank : rank + 1] for s in range(world)], 1),
        )
    return True


def test_half_precision_data_without_codec():
    assert all(run_world(_half_precision_without_codec, 3))


# ---------------------------------------------------------------------------------------------------
# bad input: the same error on every rank, never a hang


def _error_message(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def _bad_input_fails_on_every_rank():
    world, rank = dist.get_world_size(), dist.get_rank()
    messages = {}
    # rank 1's batch sizes do not sum to its rows: every rank learns it
    rows = sum(BATCH[:world]) + (1 if rank == 1 else 0)
    messages["sum"] = _error_message(
        lambda: alltoall_pooled(torch.zeros(rows, 2), BATCH[:world], [2] * world).wait()
    )
    # one split too many, on every rank
    messages["count"] = _error_message(
        lambda: reduce_scatter_v_pooled(torch.zeros(world + 1, 2), [1] * (world + 1)).wait()
    )
    # locally consistent, but rank 0 sends rank 1 two rows where rank 1 expects one
    sent_rows = [1] * world
    if rank == 0:
        sent_rows[1] = 2
    messages["exchange"] = _error_message(
        lambda: alltoall_sequence(
            torch.zeros(sum(sent_rows), 2), None, None, torch.zeros(0), [1] * world, sent_rows
        ).wait()
    )
    # ranks disagree on the dtype, and on the embedding dim of a sequence all-to-all
    dtype = torch.float32 if rank == 0 else torch.float64
    messages["dtype"] = _error_message(lambda: all_gather_base_pooled(torch.zeros(2, 2, dtype=dtype)).wait())
    dim = 3 if rank == 2 else 2
    messages["dim"] = _error_message(
        lambda: alltoall_sequence(
            torch.zeros(world, dim), None, None, torch.zeros(0), [1] * world, [1] * world
        )
    )
    # the group is still in step: a valid op works after the errors
    gathered = all_gather_base_pooled(torch.full((1,), float(rank))).wait()
    assert gathered.tolist() == [float(r) for r in range(world)]
    # without validation, an error every rank makes locally still raises (no collective is entered)
    set_validation(False)
    try:
        messages["local"] = _error_message(
            lambda: reduce_scatter_v_pooled(torch.zeros(3, 2), [1] * (world + 1))
        )
    finally:
        set_validation(True)
    return messages


def test_bad_input_is_an_error_on_every_rank():
    results = run_world(_bad_input_fails_on_every_rank, 3, timeout=60)
    for messages in results:
        assert "invalid arguments on rank 1:" in messages["sum"]
        assert "batch_size_per_rank" in messages["sum"] and "rank 0:" not in messages["sum"]
        assert "input_splits has 4 entries" in messages["count"]
        assert "rank 0 sends 4 to rank 1, which expects 2" in messages["exchange"]
        assert "disagree on the dtype" in messages["dtype"]
        assert "disagree on the embedding dim" in messages["dim"]
        assert "input_splits has 4 entries" in messages["local"]


# ---------------------------------------------------------------------------------------------------
# single process: no torch.distributed at all


def test_ops_without_torch_distributed_are_local():
    x = _randn((3, 2), 230).requires_grad_()
    out = alltoall_pooled(x, [3], [2]).wait()
    assert torch.equal(out, x) and out is not x
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 2, dtype=torch.float64))
    summed = reduce_scatter_v_pooled(x.detach(), [3]).wait()
    assert torch.equal(summed, x.detach())
    # outputs may be changed in place (they are not autograd views of the receive buffer)
    x.grad = None
    for out in (
        alltoall_sequence(x, None, None, torch.zeros(0), [3], [3]).wait(),
        all_gather_base_pooled(x).wait(),
    ):
        out.mul_(2).sum().backward()
    assert torch.equal(x.grad, torch.full((3, 2), 4.0, dtype=torch.float64))


def test_gradient_division_switch_and_reset():
    assert get_gradient_division() is True
    set_gradient_division(False)
    assert get_gradient_division() is False
    reset_all()
    assert get_gradient_division() is True
    with pytest.raises(TypeError):
        set_gradient_division(1)


def test_two_pieces_sum_to_the_stacked_reduction():
    # the gloo reduce-scatter sums two ranks' pieces with one add instead of the reduction kernel:
    # the values must be the reduction's (torch.equal: a zero's sign aside), at any magnitudes
    from shardkit.distributed.comm_ops.exchange import _sum_pieces

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.int64):
        a = (torch.randn(10_007, generator=gen, dtype=torch.float64) * 1e6).to(dtype)
        b = (torch.randn(10_007, generator=gen, dtype=torch.float64) * 1e-3).to(dtype)
        pieces = torch.cat([a, b]).split([a.numel(), b.numel()])
        assert torch.equal(_sum_pieces(pieces, a.numel()), torch.stack([a, b]).sum(dim=0))
    three = [torch.randn(5, generator=gen) for _ in range(3)]
    assert torch.equal(_sum_pieces(three, 5), torch.stack(three).sum(dim=0))


def _placed_plans_reused_while_validation_is_off():
    from shardkit.distributed.comm_ops import pooled_alltoall as alltoall_module
    from shardkit.distributed.comm_ops.placement import ColumnPlacement
    from shardkit.distributed.comm_ops.request import set_gradient_division
    from shardkit.distributed.validation import set_validation, validation_enabled

    world, rank = dist.get_world_size(), dist.get_rank()
    width, blocks = 3, 2 * world
    placement = ColumnPlacement(width, [list(range(r, blocks, world)) for r in range(world)])
    built, real_plan = [], alltoall_module._PooledPlan

    class CountingPlan(real_plan):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    def step(plans, batch, seed):
        """One forward and backward; (output, input gradient) and the plans built by it."""
        before = len(built)
        gen = torch.Generator().manual_seed(seed * 10 + rank)
        x = torch.randn(sum(batch), placement.columns(rank), generator=gen, requires_grad=True)
        out = alltoall_module.alltoall_pooled_placed(x, batch, placement, plans=plans).wait()
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
        (out * weight).sum().backward()
        return out.detach(), x.grad, len(built) - before

    previous = validation_enabled()
    alltoall_module._PooledPlan = CountingPlan
    counts, same = [], []
    try:
        set_validation(False)
        plans: dict = {}
        for seed in (1, 2):  # the same sizes twice: one plan
            cached = step(plans, [2] * world, seed)
            fresh = step(None, [2] * world, seed)  # no cache: built anew
            counts.append(cached[2])
            same.append(torch.equal(cached[0], fresh[0]) and torch.equal(cached[1], fresh[1]))
        counts.append(step(plans, [3] * world, 3)[2])  # other sizes: a plan of their own
        set_gradient_division(False)  # part of the plan: a new one
        counts.append(step(plans, [2] * world, 4)[2])
        set_gradient_division(True)
        set_validation(True)  # every call checked against the other ranks: built each time
        counts.append(step(plans, [2] * world, 5)[2])
    finally:
        alltoall_module._PooledPlan = real_plan
        set_gradient_division(True)
        set_validation(previous)
    return counts, same


def test_placed_pooled_all_to_all_reuses_its_plan_while_validation_is_off():
    for counts, same in run_world(_placed_plans_reused_while_validation_is_off, 2):
        assert counts == [1, 0, 1, 1, 1]
        assert same == [True, True]
