from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardkit.sparse import JaggedTensor, KeyedJaggedTensor
from tests.sparse.jagged_model import (
    KJTModel,
    build_kjt,
    jt_rows,
    jt_weight_rows,
    kjt_models,
    kjt_to_model,
)

PROPERTY = settings(max_examples=40, deadline=None)


def permuted(model: KJTModel, indices):
    per_rank = model.stride_per_key_per_rank
    return KJTModel(
        [model.keys[i] for i in indices],
        [model.rows[i] for i in indices],
        None if model.weights is None else [model.weights[i] for i in indices],
        model.stride,
        None if per_rank is None else [per_rank[i] for i in indices],
    )


def sliced(model: KJTModel, start: int, end: int):
    return permuted(model, list(range(start, end)))


def assert_same_data(kjt: KeyedJaggedTensor, model: KJTModel):
    got = kjt_to_model(kjt)
    assert got.keys == model.keys
    assert got.rows == model.rows
    assert got.weights == model.weights
    if model.stride_per_key_per_rank is not None:
        assert got.stride_per_key_per_rank == model.stride_per_key_per_rank
    assert kjt.length_per_key() == model.length_per_key()


INT_DTYPES = st.sampled_from([torch.int32, torch.int64])


@PROPERTY
@given(kjt_models(), st.booleans(), INT_DTYPES, INT_DTYPES)
def test_construction_matches_model(model, use_offsets, lengths_dtype, values_dtype):
    kjt = build_kjt(model, use_offsets, lengths_dtype, values_dtype)
    assert kjt.values().dtype == values_dtype
    # only what was given exists until first use; the other is derived then and cached
    assert (kjt.lengths_or_none() is None) == use_offsets
    assert (kjt.offsets_or_none() is None) == (not use_offsets)
    assert_same_data(kjt, model)
    assert kjt.lengths_or_none() is not None and kjt.offsets_or_none() is not None
    lpk = model.length_per_key()
    assert kjt.offset_per_key() == [sum(lpk[:i]) for i in range(len(lpk) + 1)]
    assert kjt.stride() == model.stride
    assert kjt.variable_stride_per_key() == (model.stride_per_key_per_rank is not None)
    assert kjt.stride_per_key() == [len(feature) for feature in model.rows]
    assert (kjt.weights_or_none() is None) == (model.weights is None)
    assert kjt.lengths().dtype == lengths_dtype


@PROPERTY
@given(kjt_models())
def test_sync_constructors_cache_per_key_totals(model):
    values = torch.tensor(model.flat_values(), dtype=torch.long)
    lengths = torch.tensor(model.flat_lengths(), dtype=torch.int32)
    weights = torch.tensor(model.flat_weights()) if model.weights is not None else None
    stride = model.stride if model.stride_per_key_per_rank is None else None
    per_rank = model.stride_per_key_per_rank
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0).int()])
    for kjt in (
        KeyedJaggedTensor.from_lengths_sync(model.keys, values, lengths, weights, stride, per_rank),
        KeyedJaggedTensor.from_offsets_sync(model.keys, values, offsets, weights, stride, per_rank),
    ):
        assert kjt.length_per_key_or_none() == model.length_per_key()
        assert_same_data(kjt, model)
    lazy = KeyedJaggedTensor(model.keys, values, weights, lengths, None, stride, per_rank, validate=False)
    assert lazy.offset_per_key_or_none() is None
    assert lazy.sync().length_per_key_or_none() == model.length_per_key()
    assert lazy.unsync().offset_per_key_or_none() is None


@PROPERTY
@given(kjt_models())
def test_to_dict_and_getitem(model):
    kjt = build_kjt(model)
    as_dict = kjt.to_dict()
    assert list(as_dict) == model.keys
    for k, key in enumerate(model.keys):
        for jt in (as_dict[key], kjt[key]):
            assert isinstance(jt, JaggedTensor)
            assert jt_rows(jt) == model.rows[k]
            assert jt_weight_rows(jt) == (None if model.weights is None else model.weights[k])


@PROPERTY
@given(kjt_models(), st.data())
def test_permute(model, data):
    num_keys = len(model.keys)
    indices = data.draw(st.lists(st.integers(0, num_keys - 1), max_size=6)) if num_keys else []
    assert_same_data(build_kjt(model).permute(indices), permuted(model, indices))


@PROPERTY
@given(kjt_models(), st.data())
def test_split(model, data):
    remaining, segments = len(model.keys), []
    while remaining or data.draw(st.booleans()):
        segments.append(data.draw(st.integers(0, remaining)))
        remaining -= segments[-1]
    parts = build_kjt(model).split(segments)
    assert len(parts) == len(segments)
    start = 0
    for part, size in zip(parts, segments):
        assert_same_data(part, sliced(model, start, start + size))
        assert part.stride() == model.stride
        start += size


@PROPERTY
@given(kjt_models(), st.data())
def test_concat_of_split_is_identity(model, data):
    cut = data.draw(st.integers(0, len(model.keys)))
    kjt = build_kjt(model)
    parts = kjt.split([cut, len(model.keys) - cut])
    assert_same_data(KeyedJaggedTensor.concat(parts), model)


@PROPERTY
@given(st.booleans(), st.data())
def test_concat_of_independent_tensors(weighted, data):
    first = data.draw(kjt_models(weighted=weighted, variable=False))
    second = data.draw(kjt_models(weighted=weighted, variable=False, stride=first.stride))
    second.keys = [f"g{i}" for i in range(len(second.keys))]
    expected = KJTModel(
        first.keys + second.keys,
        first.rows + second.rows,
        None if not weighted else first.weights + second.weights,
        first.stride,
        None,
    )
    assert_same_data(KeyedJaggedTensor.concat([build_kjt(first), build_kjt(second)]), expected)


@PROPERTY
@given(kjt_models())
def test_from_jt_dict_round_trip(model):
    assume(model.keys)
    rebuilt = KeyedJaggedTensor.from_jt_dict(build_kjt(model).to_dict())
    assert kjt_to_model(rebuilt).rows == model.rows
    assert rebuilt.length_per_key() == model.length_per_key()
    uniform = len({len(f) for f in model.rows}) == 1
    assert rebuilt.variable_stride_per_key() == (not uniform)


@PROPERTY
@given(kjt_models(variable=True), st.data())
def test_inverse_indices_follow_the_keys(model, data):
    assume(model.keys and all(model.rows))  # every key needs a row for a sample to point at
    batch = model.stride + 1
    table = [[data.draw(st.integers(0, len(f) - 1)) for _ in range(batch)] for f in model.rows]
    kjt = KeyedJaggedTensor(
        model.keys,
        torch.tensor(model.flat_values(), dtype=torch.long),
        lengths=torch.tensor(model.flat_lengths(), dtype=torch.long),
        stride_per_key_per_rank=model.stride_per_key_per_rank,
        inverse_indices=(model.keys, torch.tensor(table)),
    )
    indices = data.draw(st.permutations(range(len(model.keys))))
    keys, out = kjt.permute(indices).inverse_indices()
    assert keys == [model.keys[i] for i in indices]
    assert out.tolist() == [table[i] for i in indices]
    head, tail = kjt.split([1, len(model.keys) - 1])
    assert head.inverse_indices() == (model.keys[:1], head.inverse_indices()[1])
    assert head.inverse_indices()[1].tolist() == table[:1]
    assert tail.inverse_indices()[1].tolist() == table[1:]
    assert KeyedJaggedTensor.concat([head, tail]).inverse_indices()[1].tolist() == table


def test_weights_gradient_flows_through_permute_and_split():
    weights = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([7, 8, 9]), weights, lengths=torch.tensor([1, 2]))
    head, _ = kjt.permute([1, 0, 1]).split([1, 2])
    (head.weights() * torch.tensor([10.0, 20.0])).sum().backward()
    assert weights.grad.tolist() == [0.0, 10.0, 20.0]


def test_variable_stride_reads_rows_per_key():
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([1, 2, 3, 4]),
        lengths=torch.tensor([1, 1, 0, 2]),
        stride_per_key_per_rank=[[1, 2], [1]],
    )
    assert kjt.stride() == 3
    assert kjt.stride_per_key() == [3, 1]
    assert jt_rows(kjt["a"]) == [[1], [2], []]
    assert jt_rows(kjt["b"]) == [[3, 4]]


def test_zero_batch_and_no_keys():
    zero_batch = KeyedJaggedTensor(
        ["a", "b"], torch.empty(0, dtype=torch.long), lengths=torch.empty(0, dtype=torch.int32)
    )
    assert zero_batch.stride() == 0 and zero_batch.length_per_key() == [0, 0]
    assert jt_rows(zero_batch["b"]) == []
    empty = KeyedJaggedTensor.empty(is_weighted=True)
    assert empty.keys() == [] and empty.stride() == 0 and empty.weights().numel() == 0
    assert empty.to_dict() == {} and empty.length_per_key() == []
    assert empty.lengths().dtype == torch.int32


def test_to_keeps_data_and_caches():
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a"], torch.tensor([5, 6]), torch.tensor([2, 0]), weights=torch.tensor([0.5, 1.5])
    )
    moved = kjt.to(torch.device("cpu"), non_blocking=True, dtype=torch.float64)
    assert moved.weights().dtype == torch.float64 and moved.values().dtype == torch.long
    assert moved.length_per_key_or_none() == [2]
    assert jt_rows(moved["a"]) == [[5, 6], []]


def test_to_the_device_it_is_on_returns_itself():
    # as torch.Tensor.to: nothing to move, nothing built (the pipeline moves every batch each step)
    kjt = KeyedJaggedTensor(["a"], torch.tensor([5, 6]), lengths=torch.tensor([2, 0]))
    assert kjt.to(torch.device("cpu")) is kjt
    assert kjt.to("cpu", non_blocking=True) is kjt
    converted = kjt.to("cpu", dtype=torch.float64)  # a dtype asks for a new one (weights converted)
    assert converted is not kjt and converted.values() is kjt.values()
    on_meta = kjt.to(torch.device("meta"))
    assert on_meta is not kjt and on_meta.values().device.type == "meta"
    assert on_meta.to("meta") is on_meta


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_pin_memory_and_record_stream():
    # stride 2: "a" holds bags [1] and [], "b" holds [2, 3] and []; permuted, "b"'s values come first
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 2, 0]))
    on_gpu = kjt.pin_memory().to(torch.device("cuda"), non_blocking=True)
    stream = torch.cuda.Stream()
    on_gpu.record_stream(stream)
    assert on_gpu.permute([1, 0]).to(torch.device("cpu")).values().tolist() == [2, 3, 1]


# ---- bad input --------------------------------------------------------------------------------


@PROPERTY
@given(kjt_models(weighted=False), st.data())
def test_any_corrupted_length_is_rejected_unless_it_only_leaves_a_tail(model, data):
    lengths = model.flat_lengths()
    assume(lengths)
    row = data.draw(st.integers(0, len(lengths) - 1))
    delta = data.draw(st.integers(-3, 3).filter(bool))
    lengths[row] += delta
    kjt_args = (model.keys, torch.tensor(model.flat_values(), dtype=torch.long))
    kwargs = {"lengths": torch.tensor(lengths), "stride_per_key_per_rank": model.stride_per_key_per_rank}
    if lengths[row] >= 0 and sum(lengths) < len(model.flat_values()):
        # fewer values described than given: the tail belongs to no key and is dropped, as torchrec
        kjt = KeyedJaggedTensor(*kjt_args, **kwargs)
        assert kjt.values().tolist() == model.flat_values()[: sum(lengths)]
        return
    if lengths[row] < 0:
        expected = "negative length"
    else:
        expected = f"lengths sum to {sum(lengths)} but values has only {len(model.flat_values())} elements"
    with pytest.raises(ValueError, match=expected):
        KeyedJaggedTensor(*kjt_args, **kwargs)


def test_lengths_not_summing_to_values_names_total_and_count():
    with pytest.raises(ValueError, match=r"lengths sum to 5 but values has only 3 elements.*a=2, b=3"):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 0, 1, 2]))


def test_negative_length_names_feature_and_sample():
    with pytest.raises(ValueError, match=r"negative length \(-1\) for feature 'b' at sample 1"):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2]), lengths=torch.tensor([2, 0, 1, 0, -1, 0]))


def test_weights_length_differs_from_values():
    with pytest.raises(ValueError, match="weights has 2 elements but values has 3"):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2, 3]), torch.ones(2), lengths=torch.tensor([3]))


def test_unknown_key_lists_known_keys():
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1]), lengths=torch.tensor([1, 0]))
    with pytest.raises(KeyError, match=r"unknown key 'c'; known keys: \['a', 'b'\]"):
        kjt["c"]


def test_keys_count_vs_lengths_size():
    with pytest.raises(ValueError, match="5 lengths cannot be split evenly over 2 keys"):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1]), lengths=torch.tensor([1, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match=r"2 keys \['a', 'b'\] with stride 3 need 6 lengths, got 4"):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1]), lengths=torch.tensor([1, 0, 0, 0]), stride=3)
    with pytest.raises(ValueError, match=r"stride_per_key_per_rank has 1 entries for 2 keys"):
        KeyedJaggedTensor(
            ["a", "b"], torch.tensor([1]), lengths=torch.tensor([1]), stride_per_key_per_rank=[[1]]
        )
    with pytest.raises(ValueError, match=r"stride_per_key \[2, 1\] .* needs 3 lengths, got 2"):
        KeyedJaggedTensor(
            ["a", "b"], torch.tensor([1]), lengths=torch.tensor([1, 0]), stride_per_key_per_rank=[[1, 1], [1]]
        )


def test_bad_offsets():
    with pytest.raises(ValueError, match="offsets must start at 0"):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2]), offsets=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="offsets decrease"):
        KeyedJaggedTensor(["a"], torch.tensor([1]), offsets=torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match="offsets end to 2 but values has only 1"):
        KeyedJaggedTensor(["a"], torch.tensor([1]), offsets=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="not the cumulative sum"):
        KeyedJaggedTensor(
            ["a"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]), offsets=torch.tensor([0, 2, 2])
        )


def test_bad_types_and_shapes():
    with pytest.raises(TypeError, match="lengths must have an integer dtype"):
        KeyedJaggedTensor(["a"], torch.tensor([1]), lengths=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="got a scalar"):
        KeyedJaggedTensor(["a"], torch.tensor(1), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="one of lengths or offsets"):
        KeyedJaggedTensor(["a"], torch.tensor([1]))
    with pytest.raises(ValueError, match="length_per_key"):
        KeyedJaggedTensor(["a"], torch.tensor([1]), lengths=torch.tensor([1]), length_per_key=[2])


def test_validate_false_skips_content_checks_only():
    lengths = torch.tensor([2, -1])
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1]), lengths=lengths, validate=False)
    assert kjt.lengths() is lengths
    with pytest.raises(ValueError, match="weights has"):
        KeyedJaggedTensor(["a"], torch.tensor([1]), torch.ones(3), lengths=torch.tensor([1]), validate=False)


def test_bad_permute_split_concat_and_inverse_indices():
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    with pytest.raises(IndexError, match=r"indices \[2\] out of range for 2 keys"):
        kjt.permute([0, 2])
    with pytest.raises(ValueError, match="must be >= 0 and sum to 2 keys"):
        kjt.split([1])
    weighted = KeyedJaggedTensor(["c"], torch.tensor([3]), torch.ones(1), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="cannot mix weighted and unweighted"):
        KeyedJaggedTensor.concat([kjt, weighted])
    other_stride = KeyedJaggedTensor(["c"], torch.tensor([3]), lengths=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"strides differ: \[1, 2\]"):
        KeyedJaggedTensor.concat([kjt, other_stride])
    with pytest.raises(ValueError, match="inverse_indices keys"):
        KeyedJaggedTensor(
            ["a"], torch.tensor([1]), lengths=torch.tensor([1]), inverse_indices=(["x"], torch.zeros(1, 2))
        )
    with pytest.raises(ValueError, match=r"inverse_indices must lie in \[0, stride_per_key\)"):
        KeyedJaggedTensor(
            ["a"],
            torch.tensor([1]),
            lengths=torch.tensor([1]),
            stride_per_key_per_rank=[[1]],
            inverse_indices=(["a"], torch.tensor([[0, 1]])),
        )


def test_bad_from_jt_dict_and_concat_of_inverse_indices():
    weighted = JaggedTensor(torch.tensor([1]), torch.ones(1), lengths=torch.tensor([1]))
    plain = JaggedTensor(torch.tensor([2]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"some features are weighted, these are not: \['b'\]"):
        KeyedJaggedTensor.from_jt_dict({"a": weighted, "b": plain})
    with pytest.raises(ValueError, match="needs at least one JaggedTensor"):
        KeyedJaggedTensor.from_jt_dict({})

    def variable(key, batch):
        return KeyedJaggedTensor(
            [key],
            torch.tensor([1]),
            lengths=torch.tensor([1]),
            stride_per_key_per_rank=[[1]],
            inverse_indices=([key], torch.zeros(1, batch, dtype=torch.long)),
        )

    with pytest.raises(ValueError, match=r"inverse_indices cover different batches: \[2, 3\]"):
        KeyedJaggedTensor.concat([variable("a", 2), variable("b", 3)])
    plain_kjt = KeyedJaggedTensor(["c"], torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="only some inputs have inverse_indices"):
        KeyedJaggedTensor.concat([variable("a", 2), plain_kjt])


def _same_state(a, b):
    """Both KJTs hold the same state: the same attributes, tensors identical or equal, lists equal."""
    assert set(vars(a)) == set(vars(b))
    for name, value in vars(a).items():
        other = vars(b)[name]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and torch.equal(value, other), name
            assert value.dtype == other.dtype and value.shape == other.shape, name
        else:
            assert value == other, name


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("per_key", [None, [3, 0, 2]])
def test_trusted_kjt_is_the_checked_one(weighted, per_key):
    """The library's unchecked constructor (per-step KJTs) builds exactly what __init__ builds."""
    values = torch.arange(7)  # with per_key given, one value past the last key: dropped by both
    weights = torch.rand(7) if weighted else None
    lengths = torch.tensor([1, 2, 0, 0, 2, 0], dtype=torch.int32)
    keys = ["a", "b", "c"]
    checked = KeyedJaggedTensor(
        keys, values, weights, lengths=lengths, stride=2, length_per_key=per_key, validate=False
    )
    trusted = KeyedJaggedTensor._trusted(list(keys), values, weights, lengths, 2, per_key)
    _same_state(trusted, checked)
    assert trusted.to_dict()["c"].values().tolist() == checked.to_dict()["c"].values().tolist()
    assert trusted.length_per_key() == checked.length_per_key()


def test_trusted_kjt_empty_and_rows_mismatch():
    empty = torch.zeros(0, dtype=torch.int64)
    _same_state(
        KeyedJaggedTensor._trusted([], empty, None, torch.zeros(0, dtype=torch.int32), 0),
        KeyedJaggedTensor([], empty, lengths=torch.zeros(0, dtype=torch.int32), stride=0, validate=False),
    )
    rows = torch.rand(3, 4)  # [N, D] values
    lengths = torch.tensor([2, 1, 0, 0])
    _same_state(
        KeyedJaggedTensor._trusted(["a", "b"], rows, None, lengths, 2),
        KeyedJaggedTensor(["a", "b"], rows, lengths=lengths, stride=2, validate=False),
    )
    with pytest.raises(ValueError):
        KeyedJaggedTensor._trusted(["a", "b"], rows, None, lengths, 3)  # 6 rows, 4 lengths
