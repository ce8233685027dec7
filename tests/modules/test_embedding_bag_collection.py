"""EmbeddingBagCollection against one nn.EmbeddingBag per table: forward, gradients, keys, state dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.modules import DataType, EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from shardkit.sparse import KeyedJaggedTensor
from tests.modules._inputs import random_kjt

TOLERANCE = {
    DataType.FP32: dict(rtol=1e-5, atol=1e-6),
    DataType.FP16: dict(rtol=1e-2, atol=1e-2),
    DataType.BF16: dict(rtol=5e-2, atol=5e-2),
}


def _tables(data_type=DataType.FP32, pooling=PoolingType.SUM):
    # t1 shares its rows between two features; t3 has t1's dim, so they share one buffer
    return [
        EmbeddingBagConfig(
            num_embeddings=10,
            embedding_dim=4,
            name="t1",
            feature_names=["f1", "f3"],
            data_type=data_type,
            pooling=pooling,
        ),
        EmbeddingBagConfig(
            num_embeddings=7,
            embedding_dim=3,
            name="t2",
            feature_names=["f2"],
            data_type=data_type,
            pooling=pooling,
        ),
        EmbeddingBagConfig(
            num_embeddings=5,
            embedding_dim=4,
            name="t3",
            feature_names=["f4"],
            data_type=data_type,
            pooling=PoolingType.SUM,
        ),
    ]


def _reference(ebc: EmbeddingBagCollection, features: KeyedJaggedTensor, weighted: bool):
    """Per feature: nn.EmbeddingBag of a copy of its table (fp32), and those copies for gradients."""
    bags = {}
    for table in ebc.embedding_bag_configs():
        mode = "sum" if table.pooling is PoolingType.SUM else "mean"
        bag = nn.EmbeddingBag(table.num_embeddings, table.embedding_dim, mode=mode, include_last_offset=True)
        bag.weight.data.copy_(ebc.table_weight(table.name).detach().float())
        bags[table.name] = bag
    outputs = {}
    for table in ebc.embedding_bag_configs():
        for feature in table.feature_names:
            jt = features[feature]
            offsets = jt.offsets().long()
            if weighted and table.pooling is PoolingType.MEAN:
                # nn.EmbeddingBag has no weighted mean: weighted sum divided by the bag length
                total = nn.functional.embedding_bag(
                    jt.values(),
                    bags[table.name].weight,
                    offsets,
                    mode="sum",
                    per_sample_weights=jt.weights(),
                    include_last_offset=True,
                )
                outputs[feature] = total / jt.lengths().clamp(min=1).unsqueeze(1)
            else:
                outputs[feature] = bags[table.name](
                    jt.values(), offsets, per_sample_weights=jt.weights() if weighted else None
                )
    return outputs, bags


ROWS = {"f1": 10, "f2": 7, "f3": 10, "f4": 5}


@pytest.mark.parametrize("data_type", list(TOLERANCE))
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_and_gradients_match_embedding_bag(data_type, pooling, weighted):
    ebc = EmbeddingBagCollection(_tables(data_type, pooling), is_weighted=weighted)
    features = random_kjt(ROWS, batch=5, weighted=weighted, seed=11, keys=["f4", "f2", "f1", "f3"])
    out = ebc(features)
    assert out.keys() == ["f1", "f3", "f2", "f4"]  # tables in order, each table's features in order
    assert out.length_per_key() == [4, 4, 3, 4]
    assert out.values().shape == (5, 15)
    assert out.values().dtype == ebc.table_weight("t1").dtype

    ref_out, bags = _reference(ebc, features, weighted)
    for key in out.keys():
        torch.testing.assert_close(out[key].float(), ref_out[key], **TOLERANCE[data_type])

    grad = torch.randn(out.values().shape, generator=torch.Generator().manual_seed(0))
    (out.values().float() * grad).sum().backward()
    torch.cat([ref_out[k] for k in out.keys()], dim=1).mul(grad).sum().backward()
    for name, bag in bags.items():
        torch.testing.assert_close(ebc.table_grad(name).float(), bag.weight.grad, **TOLERANCE[data_type])


def test_one_kernel_call_per_group():
    ebc = EmbeddingBagCollection(_tables())
    # t1 and t3 (dim 4) share a buffer; t2 (dim 3) is alone
    assert [[s.table_name for s in lookup.shards] for lookup in ebc.lookups] == [["t1", "t3"], ["t2"]]
    assert ebc.lookups[0].weight.shape == (15, 4)
    calls = []
    original = torch.nn.functional.embedding_bag

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    torch.nn.functional.embedding_bag = counting
    try:
        ebc(random_kjt(ROWS, batch=3))
    finally:
        torch.nn.functional.embedding_bag = original
    assert len(calls) == 2


def test_shared_table_gets_both_features_gradients():
    ebc = EmbeddingBagCollection(_tables())
    # B = 2; f1 and f3 (both table t1) look up id 2 in sample 0; f4 looks up id 1 in sample 1
    features = KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f2", "f3", "f4"], torch.tensor([2, 2, 1]), torch.tensor([1, 0, 0, 0, 1, 0, 0, 1])
    )
    out = ebc(features)
    torch.testing.assert_close(out["f1"][0], out["f3"][0])  # same table, same id -> same row
    (out["f1"].sum() + 2 * out["f3"].sum()).backward()
    grad = ebc.table_grad("t1")
    assert grad[2].tolist() == [3.0] * 4  # both features' gradients reach the shared row
    assert torch.count_nonzero(grad) == 4


def test_empty_bags_pool_to_zero_for_sum_and_mean():
    ebc = EmbeddingBagCollection(_tables(pooling=PoolingType.MEAN))
    features = KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f2", "f3", "f4"], torch.tensor([1]), torch.tensor([0, 0, 0, 1, 0, 0, 0, 0])
    )
    values = ebc(features).values()
    assert torch.count_nonzero(values[0]) == 0
    assert torch.count_nonzero(values[1, 8:11]) == 3  # f2 of sample 1 looked up id 1


def test_variable_batch_per_feature_expands_with_inverse_indices():
    ebc = EmbeddingBagCollection(_tables())
    keys = ["f1", "f2", "f3", "f4"]
    # f1 has 2 distinct rows for a batch of 3 samples (samples 0 and 2 share row 0); others 3 rows
    lengths = torch.tensor([1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    values = torch.arange(12) % 5
    inverse = torch.tensor([[0, 1, 0], [0, 1, 2], [0, 1, 2], [0, 1, 2]])
    vbe = KeyedJaggedTensor(
        keys,
        values,
        lengths=lengths,
        stride_per_key_per_rank=[[2], [3], [3], [3]],
        inverse_indices=(keys, inverse),
    )
    full = KeyedJaggedTensor.from_lengths_sync(
        keys,
        torch.cat([values[0:1], values[1:3], values[0:1], values[3:]]),
        torch.tensor([1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
    )
    torch.testing.assert_close(ebc(vbe).values(), ebc(full).values())


def test_state_dict_is_keyed_by_table_and_round_trips():
    ebc = EmbeddingBagCollection(_tables())
    state = ebc.state_dict()
    assert list(state) == ["embedding_bags.t1.weight", "embedding_bags.t2.weight", "embedding_bags.t3.weight"]
    assert state["embedding_bags.t2.weight"].shape == (7, 3)
    other = EmbeddingBagCollection(_tables())
    other.load_state_dict(state)
    for name in ["t1", "t2", "t3"]:
        assert torch.equal(other.table_weight(name), ebc.table_weight(name))
    with pytest.raises(RuntimeError):
        other.load_state_dict({"embedding_bags.t1.weight": state["embedding_bags.t1.weight"]})


def test_int32_ids_and_lengths_give_the_same_result():
    ebc = EmbeddingBagCollection(_tables())
    features = random_kjt(ROWS, batch=4, seed=2)
    narrow = KeyedJaggedTensor.from_lengths_sync(
        features.keys(), features.values().int(), features.lengths().int()
    )
    torch.testing.assert_close(ebc(narrow).values(), ebc(features).values())
