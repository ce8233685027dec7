"""KJTAllToAll against a plain-Python model of the exchange, and the specification's worked example.

Every rank builds every rank's input from fixed seeds as lists of rows, runs the all-to-all on its own
input, and compares the output with the rows the model says it must receive: for each of its keys,
every source rank's rows in rank order (or stagger order).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.sharding.dist_data import KJTAllToAll, get_recat
from shardkit.sharding.dist_data.recat import feature_order
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world
from tests.sharding._inputs import KEYS, batches, build_kjt, input_rows, splits_for

# --------------------------------------------------------------------------------------------------
# the specification's example: keys A, B, C, splits [2, 1], two ranks. Ids are labels: A.Vi -> 10 + i,
# B.Vi -> 20 + i, C.Vi -> 30 + i; None is an empty row.

A = [10 + i for i in range(5)]
B = [20 + i for i in range(5)]
C = [30 + i for i in range(4)]

SPEC_INPUT = {
    0: {
        "A": [[A[0]], [], [A[1], A[2]]],
        "B": [[], [B[0]], [B[1]]],
        "C": [[C[0]], [C[1]], []],
    },
    1: {
        "A": [[A[3]], [A[4]], []],
        "B": [[], [B[2]], [B[3], B[4]]],
        "C": [[C[2]], [C[3]], []],
    },
}
SPEC_OUTPUT = {
    0: {
        "A": [[A[0]], [], [A[1], A[2]], [A[3]], [A[4]], []],
        "B": [[], [B[0]], [B[1]], [], [B[2]], [B[3], B[4]]],
    },
    1: {
        "C": [[C[0]], [C[1]], [], [C[2]], [C[3]], []],
    },
}


def _kjt(rows_per_key, weighted=False, lengths_dtype=torch.int64):
    """KJT of ``{key: [row, ...]}`` (same number of rows per key); weights = id / 100 when weighted."""
    keys = list(rows_per_key)
    lengths = [len(row) for k in keys for row in rows_per_key[k]]
    values = [v for k in keys for row in rows_per_key[k] for v in row]
    values_t = torch.tensor(values, dtype=torch.int64)
    weights = values_t.to(torch.float32) / 100 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys, values_t, torch.tensor(lengths, dtype=lengths_dtype), weights=weights
    )


def _spec_example(weighted):
    rank = dist.get_rank()
    out = KJTAllToAll(None, [2, 1])(_kjt(SPEC_INPUT[rank], weighted)).wait().wait()
    expected = _kjt(SPEC_OUTPUT[rank], weighted)
    assert out.keys() == expected.keys()
    assert out.stride() == 6 and not out.variable_stride_per_key()
    for name in ("lengths", "values"):
        got, want = getattr(out, name)(), getattr(expected, name)()
        assert got.dtype == want.dtype and torch.equal(got, want), (name, got, want)
    if weighted:
        assert torch.equal(out.weights(), expected.weights())
    else:
        assert out.weights_or_none() is None
    return out.keys(), out.lengths().tolist(), out.values().tolist()


def _weights_gradient():
    """The weights' gradient comes back to the rank and position each weight was sent from."""
    rank = dist.get_rank()
    kjt = _kjt(SPEC_INPUT[rank], weighted=True)
    weights = kjt.weights().clone().requires_grad_()
    kjt = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights, lengths=kjt.lengths())
    out = KJTAllToAll(None, [2, 1])(kjt).wait().wait()
    assert out.weights().requires_grad
    (out.weights() * out.values().to(torch.float32)).sum().backward()  # d/d weight = its id
    assert torch.equal(weights.grad, kjt.values().to(torch.float32))


def _spec_worker():
    _spec_example(weighted=True)
    _weights_gradient()
    return _spec_example(weighted=False)


def test_specification_example():
    results = run_world(_spec_worker, 2)
    assert results[0] == (
        ["A", "B"],
        [1, 0, 2, 1, 1, 0, 0, 1, 1, 0, 1, 2],
        [10, 11, 12, 13, 14, 20, 21, 22, 23, 24],
    )
    assert results[1] == (["C"], [1, 1, 0, 1, 1, 0], [30, 31, 32, 33])


# --------------------------------------------------------------------------------------------------
# generic cases against the model


def _check_case(world, rank, splits, mode, weighted, stagger):
    inputs = [input_rows(s, batches(s, mode)) for s in range(world)]
    kjt = build_kjt(inputs[rank], mode, weighted)
    splits_aw = KJTAllToAll(None, splits, stagger)(kjt)
    tensors_aw = splits_aw.wait()
    out = tensors_aw.wait()
    start = sum(splits[:rank])
    mine = KEYS[start : start + splits[rank]]
    order = feature_order(world, stagger)
    assert out.keys() == mine == tensors_aw.keys
    expected_rows = [row for k in mine for s in order for row in inputs[s][k]]
    assert out.lengths().tolist() == [len(r) for r in expected_rows]
    assert out.lengths().dtype == torch.int32 and out.values().dtype == torch.int64
    assert out.values().tolist() == [v for r in expected_rows for v in r]
    if weighted:
        torch.testing.assert_close(out.weights(), out.values().to(torch.float64) / 7, rtol=0, atol=0)
    if mode == "variable":
        assert out.stride_per_key_per_rank() == [[len(inputs[s][k]) for s in order] for k in mine]
        assert tensors_aw.stride_per_rank is None
    else:
        sizes = [len(inputs[s][KEYS[0]]) for s in range(world)]
        assert tensors_aw.stride_per_rank == sizes
        assert out.stride() == sum(sizes) and not out.variable_stride_per_key()
    # the splits the output dists need
    sent = [
        sum(len(r) for k in KEYS[sum(splits[:d]) : sum(splits[: d + 1])] for r in inputs[rank][k])
        for d in range(world)
    ]
    got = [sum(len(r) for k in mine for r in inputs[s][k]) for s in range(world)]
    assert tensors_aw.input_splits["values"] == sent and tensors_aw.output_splits["values"] == got
    if mode != "variable" and len(set(tensors_aw.stride_per_rank)) == 1:
        assert tensors_aw.recat.tolist() == get_recat(splits[rank], world, stagger)


def _generic_worker():
    world, rank = dist.get_world_size(), dist.get_rank()
    cases = 0
    for splits in splits_for(world):
        for mode in ("equal", "uneven", "variable"):
            for weighted in (False, True):
                _check_case(world, rank, splits, mode, weighted, 1)
                cases += 1
    if world == 4:
        _check_case(world, rank, [2, 1, 1, 1], "equal", True, 2)
        _check_case(world, rank, [2, 1, 1, 1], "uneven", False, 2)
        cases += 2
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_against_model(world):
    assert len(set(run_world(_generic_worker, world))) == 1


def test_get_recat_matches_documented_examples():
    assert get_recat(2, 4, 1) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert get_recat(2, 4, 2) == [0, 4, 2, 6, 1, 5, 3, 7]
    assert get_recat(0, 3) == []


# --------------------------------------------------------------------------------------------------
# bad input: the same ValueError on every rank, and the group still works afterwards


def _expect_error(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()


def _bad_input_worker():
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = input_rows(0, [2] * len(KEYS))
    good = build_kjt(rows, "equal", False)
    splits = [len(KEYS) - world + 1] + [1] * (world - 1)

    def run(kjt, splits_, stagger=1):
        return KJTAllToAll(None, splits_, stagger)(kjt).wait().wait()

    # keys in a different order on the last rank
    swapped = good.permute([1, 0, 2, 3, 4]) if rank == world - 1 else good
    _expect_error(lambda: run(swapped, splits), "disagree on the keys")
    # splits that do not sum to the number of keys, on one rank only
    short = [s - 1 if i == 0 else s for i, s in enumerate(splits)]
    _expect_error(lambda: run(good, short if rank == 0 else splits), r"invalid input.*sum to")
    # a wrong number of splits everywhere
    _expect_error(lambda: run(good, splits + [0]), r"invalid input.*entries for a group")
    # valid but different splits on different ranks
    other = [splits[0] - 1, splits[1] + 1, *splits[2:]]
    _expect_error(lambda: run(good, other if rank == 1 else splits), "disagree on the splits")
    # weighted on one rank only
    weighted = build_kjt(rows, "equal", True)
    _expect_error(lambda: run(weighted if rank == 0 else good, splits), "disagree on the weights dtype")
    # weights requiring grad on one rank only: its backward would wait for the others
    learned = build_kjt(rows, "equal", True)
    learned = KeyedJaggedTensor(
        learned.keys(), learned.values(), learned.weights().requires_grad_(), lengths=learned.lengths()
    )
    _expect_error(lambda: run(learned if rank == 0 else weighted, splits), "weights requiring grad")
    # not a KJT on one rank
    _expect_error(lambda: run("features" if rank == 0 else good, splits), "must be a KeyedJaggedTensor")
    # a stagger that does not divide the world
    _expect_error(lambda: run(good, splits, stagger=world + 1), "stagger")
    # the group is still usable
    out = run(good, splits)
    return out.keys()


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_raises_on_every_rank(world):
    run_world(_bad_input_worker, world, timeout=60)


def test_bad_input_single_rank_raises_at_forward():
    good = build_kjt(input_rows(0, [2] * len(KEYS)), "equal", False)
    with pytest.raises(ValueError, match="sum to"):
        KJTAllToAll(None, [4])(good)
