"""PositionWeightedModule and FeatureProcessedEmbeddingBagCollection against explicit weights."""

from __future__ import annotations

import pytest
import torch

from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FeatureProcessedEmbeddingBagCollection,
    PositionWeightedModule,
)
from shardkit.sparse import JaggedTensor, KeyedJaggedTensor


def test_position_weights_follow_position_in_bag():
    module = PositionWeightedModule(3)
    with torch.no_grad():
        module.position_weight.copy_(torch.tensor([1.0, 10.0, 100.0]))
    jt = JaggedTensor(torch.tensor([5, 6, 7, 8, 9, 4]), lengths=torch.tensor([2, 0, 3, 1]))
    out = module(jt)
    assert out.weights().tolist() == [1.0, 10.0, 1.0, 10.0, 100.0, 1.0]
    assert torch.equal(out.values(), jt.values()) and torch.equal(out.lengths(), jt.lengths())


def test_bag_longer_than_max_feature_length_raises():
    module = PositionWeightedModule(2)
    with pytest.raises(ValueError, match="max_feature_length 2"):
        module(JaggedTensor(torch.tensor([1, 2, 3]), lengths=torch.tensor([3])))


def _fp_ebc():
    tables = [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t1", feature_names=["f1", "f2"]),
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=2, name="t2", feature_names=["f3"]),
    ]
    ebc = EmbeddingBagCollection(tables, is_weighted=True)
    return FeatureProcessedEmbeddingBagCollection(
        ebc, {"f1": PositionWeightedModule(3), "f3": PositionWeightedModule(2)}
    )


def test_feature_processed_ebc_matches_explicit_weights_and_trains_positions():
    fp = _fp_ebc()
    with torch.no_grad():
        fp._feature_processors["f1"].position_weight.copy_(torch.tensor([0.5, 2.0, 3.0]))
    keys = ["f1", "f2", "f3"]
    values = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    lengths = torch.tensor([3, 0, 1, 1, 1, 1])
    out = fp(KeyedJaggedTensor.from_lengths_sync(keys, values, lengths))
    # f1: position weights; f2: no processor and no input weights -> 1; f3: initial position weights 1
    explicit = torch.tensor([0.5, 2.0, 3.0, 1.0, 1.0, 1.0, 1.0])
    expected = fp.embedding_bag_collection(
        KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=explicit)
    )
    torch.testing.assert_close(out.values(), expected.values())

    out.values().sum().backward()
    grad = fp._feature_processors["f1"].position_weight.grad
    rows = fp.embedding_bag_collection.table_weight("t1").detach()
    assert torch.allclose(grad, rows[[1, 2, 3]].sum(dim=1))  # d(sum of pooled)/d(weight of position p)
    assert fp._feature_processors["f3"].position_weight.grad is not None
    state = fp.state_dict()
    assert "_feature_processors.f1.position_weight" in state
    assert state["_embedding_bag_collection.embedding_bags.t2.weight"].shape == (10, 2)
    fp.reset_parameters()
    assert torch.equal(fp._feature_processors["f1"].position_weight.detach(), torch.ones(3))


def test_feature_processed_ebc_needs_weighted_ebc_and_known_features():
    tables = [EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t1", feature_names=["f1"])]
    with pytest.raises(ValueError, match="is_weighted=True"):
        FeatureProcessedEmbeddingBagCollection(
            EmbeddingBagCollection(tables), {"f1": PositionWeightedModule(3)}
        )
    with pytest.raises(KeyError, match="known features"):
        FeatureProcessedEmbeddingBagCollection(
            EmbeddingBagCollection(tables, is_weighted=True), {"nope": PositionWeightedModule(3)}
        )
