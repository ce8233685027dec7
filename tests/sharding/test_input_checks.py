"""check_input's id range check (validation on): the same verdict and message as checking each feature
in turn, for the first bad id in value order; features no table looks up are not checked."""

from types import SimpleNamespace

import pytest
import torch

from shardkit.distributed.validation import set_validation
from shardkit.sharding.input_checks import check_input
from shardkit.sparse import KeyedJaggedTensor

ONE_RANK = SimpleNamespace(world_size=1, process_group=None)


def _per_feature_verdict(kjt, rows):
    """The reference: each looked-up feature in key order, its first id outside [0, rows)."""
    for key, ids in zip(kjt.keys(), kjt.values().split(kjt.length_per_key())):
        if key in rows:
            bad = ids[(ids < 0) | (ids >= rows[key])]
            if bad.numel():
                return f"id {int(bad[0])} of feature {key!r} is out of range [0, {rows[key]})"
    return None


def _verdict(kjt, rows):
    try:
        check_input(kjt, [], False, "M", ONE_RANK, rows=rows)
    except ValueError as err:
        return str(err)
    return None


@pytest.fixture(autouse=True)
def _validation_on():
    set_validation(True)
    yield
    set_validation(True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_matches_the_per_feature_check_on_random_inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    keys = ["a", "b", "c", "ignored", "d"]
    rows = {"a": 5, "b": 1, "c": 7, "d": 3}
    for _ in range(200):
        lengths = torch.randint(0, 3, (len(keys) * 2,), generator=gen)  # empty bags and empty keys too
        values = torch.randint(-2, 9, (int(lengths.sum()),), generator=gen, dtype=dtype)
        kjt = KeyedJaggedTensor(keys, values, lengths=lengths)
        expected = _per_feature_verdict(kjt, rows)
        got = _verdict(kjt, rows)
        if expected is None:
            assert got is None
        else:
            assert got is not None and got.endswith(expected), (got, expected)


def test_ids_of_a_feature_no_table_looks_up_are_not_checked():
    kjt = KeyedJaggedTensor(["a", "x"], torch.tensor([0, -5, 10**9]), lengths=torch.tensor([1, 2]))
    assert _verdict(kjt, {"a": 1}) is None


def test_the_first_bad_id_in_value_order_is_named():
    # key "b" comes first in the input; its bad id is reported even though "a" has one too
    kjt = KeyedJaggedTensor(["b", "a"], torch.tensor([0, 4, 9, 2]), lengths=torch.tensor([2, 2]))
    message = _verdict(kjt, {"a": 3, "b": 4})
    assert "id 4 of feature 'b' is out of range [0, 4)" in message


def test_no_ids_at_all_passes():
    kjt = KeyedJaggedTensor(["a"], torch.tensor([], dtype=torch.int64), lengths=torch.tensor([0, 0]))
    assert _verdict(kjt, {"a": 3}) is None
