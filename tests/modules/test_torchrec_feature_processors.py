"""torchrec's feature processors by their documented behaviour: the dict-based
``feature_processor.PositionWeightedModule``, ``PositionWeightedProcessor``, ``feature_processor_``'s
``PositionWeightedModuleCollection``, and ``FeatureProcessedEmbeddingBagCollection`` with a collection
and ``split()``."""

from __future__ import annotations

import pytest
import torch

from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FeatureProcessedEmbeddingBagCollection,
    feature_processor,
    feature_processor_,
)
from shardkit.sparse import KeyedJaggedTensor

# f0: [[1, 2], []], f1: [[3], [4, 5, 6]], f2: [[7], [8]]
KJT = KeyedJaggedTensor.from_lengths_sync(
    ["f0", "f1", "f2"], torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.tensor([2, 0, 1, 3, 1, 1])
)
W0 = torch.tensor([0.5, 2.0, 3.0])
W1 = torch.tensor([1.5, 0.25, 4.0])


def _set(weights):
    with torch.no_grad():
        weights["f0"].copy_(W0)
        weights["f1"].copy_(W1)


def test_dict_position_weighted_module_weighs_its_features_and_passes_the_rest():
    module = feature_processor.PositionWeightedModule({"f0": 3, "f1": 3})
    assert all(torch.equal(w, torch.ones(3)) for w in module.position_weights.values())
    _set(module.position_weights)
    out = module(KJT.to_dict())
    assert out["f0"].weights().tolist() == [0.5, 2.0]
    assert out["f1"].weights().tolist() == [1.5, 1.5, 0.25, 4.0]
    assert out["f2"].weights_or_none() is None
    out["f1"].weights().sum().backward()
    assert module.position_weights["f1"].grad.tolist() == [2.0, 1.0, 1.0]


def test_position_weighted_processor_keeps_only_processed_features():
    processor = feature_processor.PositionWeightedProcessor({"f0": 3, "f1": 3})
    _set(processor.position_weights)
    out = processor(KJT)
    assert out.keys() == ["f0", "f1"]
    assert out.weights().tolist() == [0.5, 2.0, 1.5, 1.5, 0.25, 4.0]
    assert out.values().tolist() == [1, 2, 3, 4, 5, 6]


def test_position_weighted_module_collection_weighs_all_features():
    collection = feature_processor_.PositionWeightedModuleCollection({"f0": 3, "f1": 3})
    _set(collection.position_weights)
    out = collection(KJT)
    assert out.keys() == KJT.keys()
    assert out.weights().tolist() == [0.5, 2.0, 1.5, 1.5, 0.25, 4.0, 1.0, 1.0]
    assert set(collection.position_weights_dict) == {"f0", "f1"}
    with pytest.raises(ValueError, match="a bag of feature 'f1' has 3 ids, more than max_feature_length 2"):
        feature_processor_.PositionWeightedModuleCollection({"f1": 2})(KJT)


def _weighted_ebc():
    tables = [EmbeddingBagConfig(10, 2, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(3)]
    return EmbeddingBagCollection(tables, is_weighted=True)


def test_fp_ebc_with_a_collection_or_a_dict_and_split():
    torch.manual_seed(0)
    ebc = _weighted_ebc()
    collection = feature_processor_.PositionWeightedModuleCollection({"f0": 3, "f1": 3})
    _set(collection.position_weights)
    fp_ebc = FeatureProcessedEmbeddingBagCollection(ebc, collection)
    processors, inner = fp_ebc.split()
    assert processors is collection and inner is ebc and fp_ebc.is_weighted()
    torch.testing.assert_close(fp_ebc(KJT).values(), ebc(collection(KJT)).values())
    per_feature = {f: feature_processor_.PositionWeightedModule(3) for f in ("f0", "f1")}
    by_dict = FeatureProcessedEmbeddingBagCollection(ebc, per_feature)
    wrapper, _ = by_dict.split()
    assert isinstance(wrapper, feature_processor_.FeatureProcessorsCollection)
    assert wrapper(KJT).weights().tolist() == [1.0] * 8
    assert [k for k in by_dict.state_dict() if "position" in k] == [
        "_feature_processors.f0.position_weight",
        "_feature_processors.f1.position_weight",
    ]
