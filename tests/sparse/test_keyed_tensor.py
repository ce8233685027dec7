from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.sparse import KeyedTensor

PROPERTY = settings(max_examples=40, deadline=None)


@st.composite
def keyed_tensors(draw, prefix: str, batch: int):
    """A KeyedTensor, its model (key -> rows, each row the key's columns) and key -> width."""
    dims = draw(st.lists(st.integers(0, 3), max_size=4))
    keys = [f"{prefix}{i}" for i in range(len(dims))]
    total = sum(dims)
    values = torch.tensor(
        draw(st.lists(st.integers(-50, 50), min_size=batch * total, max_size=batch * total))
    )
    values = values.view(batch, total).float()
    model, start = {}, 0
    for key, dim in zip(keys, dims):
        model[key] = [row[start : start + dim] for row in values.tolist()]
        start += dim
    return KeyedTensor(keys, dims, values), model, dict(zip(keys, dims))


def concat_rows(parts, batch):
    return [[x for part in parts for x in part[b]] for b in range(batch)]


@PROPERTY
@given(st.integers(0, 3), st.data())
def test_to_dict_getitem_offsets(batch, data):
    kt, model, widths = data.draw(keyed_tensors("k", batch))
    assert kt.keys() == list(model)
    assert {k: v.tolist() for k, v in kt.to_dict().items()} == model
    for key, rows in model.items():
        assert kt[key].tolist() == rows
        assert kt[key].shape == (batch, widths[key])
    lengths = list(widths.values())
    assert kt.length_per_key() == lengths
    assert kt.offset_per_key() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]


@PROPERTY
@given(st.integers(0, 3), st.data())
def test_regroup_matches_model(batch, data):
    first, first_model, first_widths = data.draw(keyed_tensors("a", batch))
    second, second_model, second_widths = data.draw(keyed_tensors("b", batch))
    model = {**first_model, **second_model}
    widths = {**first_widths, **second_widths}
    group = st.lists(st.sampled_from(list(model)), max_size=5) if model else st.just([])
    groups = data.draw(st.lists(group, max_size=3))
    out = KeyedTensor.regroup([first, second], groups)
    assert len(out) == len(groups)
    for group, tensor in zip(groups, out):
        assert tensor.shape == (batch, sum(widths[k] for k in group))
        assert tensor.tolist() == concat_rows([model[k] for k in group], batch)
    names = [f"g{i}" for i in range(len(groups))]
    named = KeyedTensor.regroup_as_dict([first, second], groups, names)
    assert list(named) == names
    assert [t.tolist() for t in named.values()] == [t.tolist() for t in out]


def test_regroup_is_differentiable_and_copies():
    values = torch.arange(12.0).view(2, 6).requires_grad_()
    kt = KeyedTensor(["x", "y", "z"], [1, 2, 3], values)
    (xz, y) = KeyedTensor.regroup([kt], [["z", "x"], ["y"]])
    (xz.sum() * 2 + y.sum()).backward()
    assert values.grad.tolist() == [[2, 1, 1, 2, 2, 2]] * 2
    (yz,) = KeyedTensor.regroup([kt], [["y", "z"]])
    assert yz.data_ptr() != values.data_ptr()


def test_key_dim_zero_and_from_tensor_list():
    kt = KeyedTensor.from_tensor_list(["a", "b"], [torch.ones(1, 3), torch.zeros(2, 3)], key_dim=0, cat_dim=0)
    assert kt.key_dim() == 0 and kt.length_per_key() == [1, 2]
    assert kt["b"].shape == (2, 3)
    (ba,) = KeyedTensor.regroup([kt], [["b", "a"]])
    assert ba[:, 0].tolist() == [0, 0, 1]


def test_bad_input():
    with pytest.raises(ValueError, match="length_per_key sums to 4 but values has 3 along key_dim 1"):
        KeyedTensor(["a", "b"], [2, 2], torch.zeros(2, 3))
    with pytest.raises(ValueError, match="2 keys but 1 entries"):
        KeyedTensor(["a", "b"], [3], torch.zeros(2, 3))
    with pytest.raises(ValueError, match="negative length for key 'b'"):
        KeyedTensor(["a", "b"], [4, -1], torch.zeros(2, 3))
    kt = KeyedTensor(["a", "b"], [1, 2], torch.zeros(2, 3))
    with pytest.raises(KeyError, match=r"unknown key 'c'; known keys: \['a', 'b'\]"):
        kt["c"]
    with pytest.raises(KeyError, match=r"unknown key 'c'; known keys: \['a', 'b', 'd'\]"):
        KeyedTensor.regroup([kt, KeyedTensor(["d"], [1], torch.zeros(2, 1))], [["a", "c"]])
    with pytest.raises(ValueError, match="incompatible"):
        KeyedTensor.regroup([kt, KeyedTensor(["d"], [1], torch.zeros(3, 1))], [["a"]])
