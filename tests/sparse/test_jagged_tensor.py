from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.sparse import JaggedTensor
from tests.sparse.jagged_model import jt_rows, jt_weight_rows, row_lists

PROPERTY = settings(max_examples=40, deadline=None)


@st.composite
def jagged(draw, max_rows: int = 5):
    rows = draw(row_lists(draw(st.integers(0, max_rows)), max_len=4))
    weighted = draw(st.booleans())
    weights = [[float(draw(st.integers(-5, 5))) for _ in row] for row in rows] if weighted else None
    return rows, weights


def build(rows, weights=None, use_offsets=False, dtype=torch.int64):
    lengths = torch.tensor([len(r) for r in rows], dtype=dtype)
    values = torch.tensor([v for r in rows for v in r], dtype=torch.long)
    flat_weights = torch.tensor([w for r in weights for w in r]) if weights is not None else None
    if use_offsets:
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0).to(dtype)])
        return JaggedTensor(values, flat_weights, offsets=offsets)
    return JaggedTensor(values, flat_weights, lengths=lengths)


def padded(rows, length, pad):
    return [(row + [pad] * length)[:length] for row in rows]


@PROPERTY
@given(jagged(), st.booleans(), st.sampled_from([torch.int32, torch.int64]))
def test_rows_lengths_offsets(data, use_offsets, dtype):
    rows, weights = data
    jt = build(rows, weights, use_offsets, dtype)
    assert (jt.lengths_or_none() is None) == use_offsets
    assert (jt.offsets_or_none() is None) == (not use_offsets)
    assert jt_rows(jt) == rows
    assert jt_weight_rows(jt) == weights
    assert jt.lengths().tolist() == [len(r) for r in rows]
    assert jt.offsets().tolist() == [sum(len(r) for r in rows[:i]) for i in range(len(rows) + 1)]
    assert jt.lengths().dtype == dtype and jt.offsets().dtype == dtype


@PROPERTY
@given(jagged(), st.one_of(st.none(), st.integers(0, 5)), st.integers(-3, 3))
def test_to_padded_dense(data, desired, pad):
    rows, weights = data
    jt = build(rows, weights)
    length = desired if desired is not None else max((len(r) for r in rows), default=0)
    assert jt.to_padded_dense(desired, pad).tolist() == padded(rows, length, pad)
    dense_weights = jt.to_padded_dense_weights(desired, float(pad))
    if weights is None:
        assert dense_weights is None
    else:
        assert dense_weights.tolist() == padded(weights, length, float(pad))


@PROPERTY
@given(jagged(), st.integers(1, 3))
def test_padded_dense_of_embedding_rows(data, dim):
    rows, _ = data
    num = sum(len(r) for r in rows)
    values = torch.arange(num * dim, dtype=torch.float).view(num, dim)
    jt = JaggedTensor(values, lengths=torch.tensor([len(r) for r in rows], dtype=torch.long))
    dense = jt.to_padded_dense(3)
    assert dense.shape == (len(rows), 3, dim)
    start = 0
    for b, row in enumerate(rows):
        kept = min(len(row), 3)
        assert torch.equal(dense[b, :kept], values[start : start + kept])
        assert not dense[b, kept:].any()
        start += len(row)
    longest = max((len(r) for r in rows), default=0)
    back = JaggedTensor.from_dense_lengths(jt.to_padded_dense(longest), jt.lengths())
    assert torch.equal(back.values(), values)


@PROPERTY
@given(jagged())
def test_to_dense_and_from_dense_round_trip(data):
    rows, weights = data
    jt = build(rows, weights)
    dense = jt.to_dense()
    assert [t.tolist() for t in dense] == rows
    dense_weights = jt.to_dense_weights()
    assert (dense_weights is None) == (weights is None)
    if rows:
        back = JaggedTensor.from_dense(dense, dense_weights)
        assert jt_rows(back) == rows and jt_weight_rows(back) == weights


@PROPERTY
@given(jagged(), st.integers(0, 2))
def test_from_dense_lengths(data, extra):
    rows, weights = data
    length = max((len(r) for r in rows), default=0) + extra
    values = torch.tensor(padded(rows, length, -1), dtype=torch.long).view(len(rows), length)
    dense_weights = None
    if weights is not None:
        dense_weights = torch.tensor(padded(weights, length, 0.0)).view(len(rows), length)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    jt = JaggedTensor.from_dense_lengths(values, lengths, dense_weights)
    assert jt_rows(jt) == rows and jt_weight_rows(jt) == weights


def test_empty_and_to():
    jt = JaggedTensor.empty(is_weighted=True, values_dtype=torch.int32)
    assert jt.values().dtype == torch.int32 and jt.lengths().numel() == 0
    assert jt.weights().numel() == 0 and jt.to_padded_dense().shape == (0, 0)
    moved = build([[1, 2], []]).to(torch.device("cpu"), non_blocking=True)
    assert jt_rows(moved) == [[1, 2], []]
    with pytest.raises(ValueError, match="use JaggedTensor.empty"):
        JaggedTensor.from_dense([])


def test_bad_input():
    with pytest.raises(ValueError, match="lengths sum to 3 but values has only 2 elements"):
        JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"negative length \(-1\) at row 1"):
        JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="weights has 1 elements but values has 2"):
        JaggedTensor(torch.tensor([1, 2]), torch.ones(1), lengths=torch.tensor([2]))
    with pytest.raises(ValueError, match="one of lengths or offsets"):
        JaggedTensor(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"offsets has 2 elements, expected lengths \+ 1 = 3"):
        JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([1, 1]), offsets=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="lengths must lie in"):
        JaggedTensor.from_dense_lengths(torch.zeros(2, 3), torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="desired_length must be >= 0"):
        build([[1]]).to_padded_dense(-1)
    # validate=False trusts the caller: no content check, so no host sync
    JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([5]), validate=False)
