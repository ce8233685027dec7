"""Bad inputs to the collections end in errors that name what is wrong."""

from __future__ import annotations

import pytest
import torch

from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from shardkit.sparse import KeyedJaggedTensor


def _ebc(**kwargs):
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t1", feature_names=["f1", "f2"]),
            EmbeddingBagConfig(num_embeddings=3, embedding_dim=4, name="t2", feature_names=["f3"]),
        ],
        **kwargs,
    )


def _kjt(keys, values, lengths, **kwargs):
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor(values), torch.tensor(lengths), **kwargs)


@pytest.mark.parametrize(
    "bad_id, feature, table", [(3, "f3", "t2"), (-1, "f3", "t2"), (10, "f2", "t1"), (-5, "f1", "t1")]
)
def test_out_of_range_or_negative_id_names_feature_table_and_id(bad_id, feature, table):
    values = {"f1": [1], "f2": [2], "f3": [0]}
    values[feature] = [bad_id]
    kjt = _kjt(["f1", "f2", "f3"], values["f1"] + values["f2"] + values["f3"], [1, 1, 1])
    with pytest.raises(IndexError, match=rf"id {bad_id} of feature '{feature}' .*table '{table}'"):
        _ebc()(kjt)


def test_sequence_collection_checks_ids_too():
    ec = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=4, embedding_dim=2, name="t", feature_names=["a"])]
    )
    with pytest.raises(IndexError, match="id 4 of feature 'a'"):
        ec(_kjt(["a"], [0, 4], [2]))


def test_missing_or_repeated_features():
    with pytest.raises(KeyError, match="contain a repeated key"):
        _ebc()(_kjt(["f1", "f2", "f3", "f1"], [1, 1, 1, 1], [1, 1, 1, 1]))
    with pytest.raises(KeyError, match=r"lacks feature\(s\) \['f3'\]"):
        _ebc()(_kjt(["f1", "f2"], [1, 1], [1, 1]))


def test_weighted_collection_needs_weights():
    with pytest.raises(ValueError, match="needs a KeyedJaggedTensor with weights"):
        _ebc(is_weighted=True)(_kjt(["f1", "f2", "f3"], [1, 1, 1], [1, 1, 1]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(values=[1, 2], lengths=[1, 1, 1]), "lengths sum"),
        (dict(values=[1, 2, 0], lengths=[2, -1, 2]), "negative"),
        (dict(values=[1, 2, 0], lengths=[1, 1, 1], weights=torch.ones(2)), "one weight per value"),
    ],
)
def test_malformed_jagged_input_is_rejected_before_the_lookup(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _kjt(["f1", "f2", "f3"], **kwargs)
