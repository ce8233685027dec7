"""The jagged types as torchrec 1.8 documents and prints them: meta device, pytree, the helper
functions and modules, the values torchrec returns, and the inputs it accepts."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from shardkit.sparse import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    jt_is_equal,
    kjt_is_equal,
    permute_multi_embedding,
    regroup_kts,
)

META = torch.device("meta")


def _kjt(weights=None):
    # a: [[1], []], b: [[2], [3]]
    return KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1, 1]), weights=weights
    )


# ---- meta device ---------------------------------------------------------------------------------


def test_kjt_and_collections_work_on_meta_with_placeholder_per_key_counts():
    values = torch.empty(5, dtype=torch.long, device=META)
    kjt = KeyedJaggedTensor(["a", "b"], values, lengths=torch.empty(4, dtype=torch.int32, device=META))
    synced = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], values, torch.empty(4, dtype=torch.int32, device=META)
    )
    assert kjt.stride() == synced.stride() == 2
    assert kjt.length_per_key() == [3, 2]  # contents unknown: an even split, as torchrec
    tables = dict(name="t", embedding_dim=2, num_embeddings=10, feature_names=["a", "b"])
    pooled = EmbeddingBagCollection([EmbeddingBagConfig(**tables)], device=META)(kjt)
    assert pooled.keys() == ["a", "b"] and pooled.values().shape == (2, 4) and pooled.values().is_meta
    sequences = EmbeddingCollection([EmbeddingConfig(**tables)], device=META)(kjt)
    assert {k: tuple(jt.values().shape) for k, jt in sequences.items()} == {"a": (3, 2), "b": (2, 2)}


# ---- pytree --------------------------------------------------------------------------------------


def test_pytree_round_trips_keep_every_field():
    kjt = _kjt(torch.tensor([0.5, 1.0, 2.0]))
    leaves, spec = pytree.tree_flatten(kjt)
    assert len(leaves) == 4 and leaves[0] is kjt.values()
    assert kjt_is_equal(pytree.tree_unflatten(leaves, spec), kjt)
    variable = KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[2], [1]],
    )
    again = pytree.tree_unflatten(*pytree.tree_flatten(variable))
    assert again.stride_per_key_per_rank() == [[2], [1]] and again.variable_stride_per_key()
    jt = JaggedTensor(torch.tensor([1.0, 2.0]), lengths=torch.tensor([2, 0]))
    assert jt_is_equal(pytree.tree_unflatten(*pytree.tree_flatten(jt)), jt)
    kt = KeyedTensor(["x", "y"], [2, 1], torch.arange(6.0).view(2, 3))
    doubled = pytree.tree_map(lambda t: t * 2, kt)
    assert doubled.keys() == ["x", "y"] and torch.equal(doubled.values(), kt.values() * 2)
    # key paths (torch.export names a KJT input's tensors by them)
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path({"batch": kjt})[0]]
    assert paths == ["['batch']._values", "['batch']._weights", "['batch']._lengths", "['batch']._offsets"]
    assert [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(kt)[0]] == ["._values"]
    assert len(pytree.tree_flatten_with_path(jt)[0]) == 4


# ---- functions and modules -----------------------------------------------------------------------


def test_regroup_kts_and_permute_multi_embedding_concatenate_the_groups_keys():
    kt1 = KeyedTensor(["a", "b"], [2, 1], torch.arange(6.0).view(2, 3))
    kt2 = KeyedTensor(["c"], [2], torch.ones(2, 2))
    for regroup in (regroup_kts, permute_multi_embedding):
        ac, b = regroup([kt1, kt2], [["a", "c"], ["b"]])
        torch.testing.assert_close(ac, torch.tensor([[0.0, 1.0, 1.0, 1.0], [3.0, 4.0, 1.0, 1.0]]))
        torch.testing.assert_close(b, torch.tensor([[2.0], [5.0]]))


def test_empty_like():
    kjt = _kjt(torch.ones(3))
    empty = KeyedJaggedTensor.empty_like(kjt)
    assert empty.keys() == [] and empty.stride() == 2 and empty.values().numel() == 0
    assert empty.weights().dtype == torch.float32 and empty.values().dtype == torch.int64
    on_meta = KeyedJaggedTensor.empty_like(kjt, META)
    assert on_meta.keys() == ["a", "b"] and on_meta.values().shape == (3,) and on_meta.values().is_meta
    jt = JaggedTensor.empty_like(kjt["b"])
    assert jt.values().numel() == 0 and jt.weights().numel() == 0


def test_equality_compares_every_field():
    assert kjt_is_equal(_kjt(), _kjt()) and not kjt_is_equal(_kjt(), _kjt(torch.ones(3)))
    other_keys = KeyedJaggedTensor.from_lengths_sync(
        ["a", "c"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1, 1])
    )
    assert not kjt_is_equal(_kjt(), other_keys) and not kjt_is_equal(_kjt(), "not a kjt")
    jt = JaggedTensor(torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 1]))
    assert jt_is_equal(jt, JaggedTensor(torch.tensor([1.0, 2.0]), offsets=torch.tensor([0, 1, 2])))
    assert not jt_is_equal(jt, JaggedTensor(torch.tensor([1.0, 2.0]), lengths=torch.tensor([2, 0])))


def test_conversion_modules():
    jts = ComputeKJTToJTDict()(_kjt())
    assert list(jts) == ["a", "b"] and jts["b"].values().tolist() == [2, 3]
    assert kjt_is_equal(ComputeJTDictToKJT()(jts), _kjt())


# ---- values torchrec returns ---------------------------------------------------------------------


def test_values_as_torchrec():
    assert JaggedTensor.empty().offsets().tolist() == []
    dense = JaggedTensor.from_dense([torch.tensor([1.0]), torch.tensor([2.0, 3.0])])
    assert dense.lengths().dtype == dense.offsets().dtype == torch.int32
    assert _kjt().stride_per_key_per_rank() == []


def test_str_prints_the_values_as_torchrec():
    dense = JaggedTensor.from_dense([torch.tensor([1.0]), torch.tensor([2.0, 3.0])])
    assert str(dense) == "JaggedTensor({\n    [[1.0], [2.0, 3.0]]\n})\n"
    weighted = JaggedTensor(torch.tensor([1, 2]), torch.tensor([0.5, 0.25]), lengths=torch.tensor([2]))
    assert str(weighted) == 'JaggedTensor({\n    "values": [[1, 2]],\n    "weights": [[0.5, 0.25]]\n})\n'
    assert str(_kjt()) == 'KeyedJaggedTensor({\n    "a": [[1], []],\n    "b": [[2], [3]]\n})\n'
    assert str(_kjt(torch.tensor([0.5, 1.0, 2.0]))) == (
        'KeyedJaggedTensor({\n    "a": {\n        "values": [[1], []],\n'
        '        "weights": [[0.5], []]\n    },\n'
        '    "b": {\n        "values": [[2], [3]],\n        "weights": [[1.0], [2.0]]\n    }\n})\n'
    )
    kt = KeyedTensor(["a", "b"], [2, 1], torch.arange(6.0).view(2, 3))
    assert str(kt) == 'KeyedTensor({\n    "a": [[0.0, 1.0], [3.0, 4.0]],\n    "b": [[2.0], [5.0]]\n})\n'
    assert str(KeyedJaggedTensor.empty()) == "KeyedJaggedTensor()\n"
    assert str(KeyedTensor([], [], torch.Tensor())) == "KeyedTensor()\n"
    # torchrec prints a row as a list of ids or of 1-D rows, and refuses deeper values
    with pytest.raises(ValueError, match=r"1 or 2 dimensions, got shape \(2, 1, 3\)"):
        str(JaggedTensor(torch.zeros(2, 1, 3), lengths=torch.tensor([1, 1])))


# ---- inputs torchrec accepts ---------------------------------------------------------------------


def test_rows_as_values():
    rows = torch.randn(3, 4)
    assert JaggedTensor(rows, lengths=torch.tensor([1, 2])).to_dense()[1].shape == (2, 4)
    kjt = KeyedJaggedTensor(["a", "b"], rows, lengths=torch.tensor([1, 0, 1, 1]))
    torch.testing.assert_close(kjt["b"].values(), rows[1:])
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=5, feature_names=["a"])]
    )
    with pytest.raises(ValueError, match=r"values must be \[N\] ids, got shape \(3, 4\)"):
        ebc(kjt)


def test_empty_lengths_of_any_dtype_and_values_longer_than_the_lengths():
    empty = JaggedTensor(torch.tensor([]), lengths=torch.tensor([]))  # float lengths, but no length in them
    assert empty.lengths().dtype == torch.int32 and empty.to_dense() == []
    assert KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([]), torch.tensor([])).stride() == 0
    with pytest.raises(TypeError, match="lengths must have an integer dtype, got torch.float32"):
        JaggedTensor(torch.tensor([1.0]), lengths=torch.tensor([1.0]))
    tail = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([1, 1, 1, 1]))
    assert tail.values().tolist() == [1, 2, 3, 4] and tail.to_dict()["b"].values().tolist() == [3, 4]
    assert JaggedTensor(torch.tensor([1, 2, 3]), lengths=torch.tensor([1])).values().tolist() == [1]


def test_no_rows_spelled_as_torchrec_does():
    # an empty offsets tensor means no rows, as offsets [0]
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([]), offsets=torch.tensor([]))
    assert kjt.stride() == 0 and kjt["a"].lengths().numel() == 0 and kjt.offsets().tolist() == [0]
    assert JaggedTensor(torch.tensor([]), offsets=torch.tensor([])).lengths().numel() == 0
    # no lengths and no offsets: fine without values (torchrec's KeyedJaggedTensor([], torch.Tensor()))
    assert KeyedJaggedTensor([], torch.Tensor()).to_dict() == {}
    with pytest.raises(ValueError, match="one of lengths or offsets is required"):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2]))
    empty = KeyedTensor([], [], torch.Tensor())
    assert empty.keys() == [] and empty.to_dict() == {}


def test_regroup_is_one_leaf_of_an_fx_graph():
    class Grouping(torch.nn.Module):
        def forward(self, kts, groups):
            # groups named in the code (regroup_as_dict compares their count) or traced (regroup_kts)
            named = KeyedTensor.regroup_as_dict(kts, [["c", "a"], ["b"]], ["x", "y"])
            return named, regroup_kts(kts, groups)

    kts = [
        KeyedTensor.from_tensor_list(["a", "b"], [torch.randn(2, 3), torch.randn(2, 1)]),
        KeyedTensor.from_tensor_list(["c"], [torch.randn(2, 2)]),
    ]
    groups = [["c", "a"], ["b"]]
    traced = torch.fx.symbolic_trace(Grouping())
    (as_dict, as_list), (ref_dict, ref_list) = traced(kts, groups), Grouping()(kts, groups)
    assert list(as_dict) == ["x", "y"]
    for got, want in zip([*as_dict.values(), *as_list], [*ref_dict.values(), *ref_list]):
        assert torch.equal(got, want)
    assert torch.equal(as_list[0], torch.cat([kts[1]["c"], kts[0]["a"]], dim=1))


def test_from_dense_lengths_is_one_leaf_of_an_fx_graph():
    class Jag(torch.nn.Module):
        def forward(self, padded, lengths):
            return JaggedTensor.from_dense_lengths(padded, lengths).values() * 2

    padded, lengths = torch.arange(12.0).view(3, 4), torch.tensor([1, 0, 3])
    traced = torch.fx.symbolic_trace(Jag())
    assert traced(padded, lengths).tolist() == [0.0, 16.0, 18.0, 20.0]
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\]"):
        traced(padded, torch.tensor([1, 5, 0]))  # the checks run when the graph runs


def test_kt_flattened_by_a_saved_spec_follows_the_spec_key_order():
    from torch.fx._pytree import tree_flatten_spec

    a, b = torch.randn(2, 1), torch.randn(2, 3)
    _, spec = pytree.tree_flatten(KeyedTensor.from_tensor_list(["a", "b"], [a, b]))
    reordered = KeyedTensor.from_tensor_list(["b", "a"], [b, a])
    (values,) = tree_flatten_spec(reordered, spec)
    assert torch.equal(values, torch.cat([a, b], dim=1))
    rebuilt = pytree.tree_unflatten([values], spec)
    assert torch.equal(rebuilt["a"], a) and torch.equal(rebuilt["b"], b)


def test_fewer_ranks_for_one_key():
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[1, 1], [1]],
    )
    assert kjt.stride_per_key() == [2, 1] and kjt["b"].values().tolist() == [3]
