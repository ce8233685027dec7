"""KTRegroupAsDict: named groups of KeyedTensor slices, optionally cast; traceable by fx."""

import pytest
import torch

from shardkit.modules import DataType, KTRegroupAsDict
from shardkit.sparse import KeyedTensor


def _kts():
    user = KeyedTensor.from_tensor_list(["age", "id"], [torch.randn(3, 2), torch.randn(3, 4)])
    item = KeyedTensor.from_tensor_list(["item"], [torch.randn(3, 5)])
    return [user, item]


def test_groups_concatenate_their_keys_in_order_and_keep_gradients():
    kts = _kts()
    kts[1].values().requires_grad_()
    module = KTRegroupAsDict(groups=[["id", "item"], ["age", "id"]], keys=["left", "right"])
    out = module(kts)
    assert list(out) == ["left", "right"]
    assert torch.equal(out["left"], torch.cat([kts[0]["id"], kts[1]["item"]], dim=1))
    assert torch.equal(out["right"], kts[0].values())  # a key used twice, another not at all
    out["left"].sum().backward()
    assert torch.equal(kts[1].values().grad, torch.ones(3, 5))


def test_cast_to_the_embedding_dtype():
    out = KTRegroupAsDict([["item"]], ["only"], emb_dtype=DataType.BF16)(_kts())
    assert out["only"].dtype == torch.bfloat16


def test_fx_trace_gives_the_eager_result():
    module = KTRegroupAsDict([["item", "age"]], ["x"])
    kts = _kts()
    traced = torch.fx.symbolic_trace(module)
    assert torch.equal(traced(kts)["x"], module(kts)["x"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="2 groups but 1 keys"):
        KTRegroupAsDict([["a"], ["b"]], ["x"])
    with pytest.raises(ValueError, match="repeated output keys"):
        KTRegroupAsDict([["a"], ["b"]], ["x", "x"])
    with pytest.raises(KeyError, match="unknown key 'nope'"):
        KTRegroupAsDict([["nope"]], ["x"])(_kts())
