from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.distributed.tensor_split import (
    divide_and_check_no_remainder,
    ensure_div,
    pad_tensor,
    split_offsets,
    split_sizes,
    split_tensor,
    trim_tensor,
)


def test_split_sizes_examples():
    assert split_sizes(5, 3) == [2, 2, 1]
    assert split_sizes(6, 3) == [2, 2, 2]
    assert split_sizes(2, 3) == [1, 1, 0]
    assert split_sizes(0, 2) == [0, 0]
    assert split_offsets([2, 2, 1]) == [0, 2, 4]


@pytest.mark.parametrize("total, parts", [(-1, 2), (3, 0), (3, -1)])
def test_split_sizes_rejects_bad_arguments(total, parts):
    with pytest.raises(ValueError):
        split_sizes(total, parts)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 60), parts=st.integers(1, 12))
def test_split_sizes_matches_array_split(total, parts):
    expected = [len(p) for p in np.array_split(np.arange(total), parts)]
    assert split_sizes(total, parts) == expected


@settings(max_examples=100, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    parts=st.integers(1, 6),
    dim_pick=st.integers(0, 5),
    negative=st.booleans(),
    contiguous=st.booleans(),
)
def test_split_tensor_matches_array_split(shape, parts, dim_pick, negative, contiguous):
    array = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    dim = dim_pick % len(shape)
    chunks = split_tensor(
        torch.from_numpy(array),
        parts,
        dim=dim - len(shape) if negative else dim,
        contiguous_chunks=contiguous,
    )
    expected = np.array_split(array, parts, axis=dim)
    assert len(chunks) == parts
    for chunk, want in zip(chunks, expected):
        assert chunk.shape == want.shape
        np.testing.assert_array_equal(chunk.numpy(), want)
        if contiguous:
            assert chunk.is_contiguous()


def test_split_tensor_views_unless_contiguous():
    t = torch.arange(12.0).reshape(3, 4)
    views = split_tensor(t, 2, dim=-1)
    assert all(v.data_ptr() >= t.data_ptr() and not v.is_contiguous() for v in views)
    copies = split_tensor(t, 2, dim=-1, contiguous_chunks=True)
    assert all(c.is_contiguous() for c in copies)
    torch.testing.assert_close(torch.cat(copies, dim=-1), t)


def test_pad_tensor_pads_with_zeros_and_never_mutates():
    t = torch.full((2, 3), 7.0)
    before = t.clone()
    out = pad_tensor(t, 0, target_size=5)
    assert out.shape == (5, 3)
    torch.testing.assert_close(out[:2], before)
    assert torch.equal(out[2:], torch.zeros(3, 3))
    out[0, 0] = -1.0
    torch.testing.assert_close(t, before)
    last = pad_tensor(t, target_size=4)  # default dim=-1
    assert last.shape == (2, 4) and torch.equal(last[:, 3], torch.zeros(2))
    assert pad_tensor(t, 1, target_size=3) is t  # nothing to pad: no copy
    assert pad_tensor(t.to(torch.bfloat16), 0, target_size=3).dtype == torch.bfloat16


def test_pad_tensor_is_differentiable():
    t = torch.randn(2, 3, requires_grad=True)
    pad_tensor(t, 0, target_size=4).sum().backward()
    torch.testing.assert_close(t.grad, torch.ones(2, 3))


def test_pad_and_trim_errors():
    t = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="smaller"):
        pad_tensor(t, 0, target_size=2)
    with pytest.raises(IndexError):
        pad_tensor(t, 2, target_size=4)
    with pytest.raises(ValueError):
        trim_tensor(t, 0, target_size=4)
    with pytest.raises(IndexError):
        trim_tensor(torch.tensor(1.0), 0, target_size=0)


def test_trim_tensor_inverts_pad():
    t = torch.randn(3, 4)
    padded = pad_tensor(t, 1, target_size=7)
    trimmed = trim_tensor(padded, 1, target_size=4)
    torch.testing.assert_close(trimmed, t)
    assert trim_tensor(t, 0, target_size=0).shape == (0, 4)


def test_ensure_div_and_divide():
    ensure_div(6, 3)
    assert divide_and_check_no_remainder(6, 3) == 2
    with pytest.raises(ValueError, match="b=3 does not divide a=7"):
        ensure_div(7, 3)
    with pytest.raises(ValueError) as info:
        divide_and_check_no_remainder(7, 2)
    assert "7" in str(info.value) and "2" in str(info.value)
    with pytest.raises(ValueError, match="b=0"):
        ensure_div(1, 0)
