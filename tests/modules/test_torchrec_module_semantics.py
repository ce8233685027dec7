"""The collections behave as torchrec's documents them for the cases real programs hit.

One KJT feeding several modules (features a module does not use are ignored), one feature looked up
by several tables (outputs ``feature@table``), the per-table ``embedding_bags`` / ``embeddings``
views and ``device``.
"""

from __future__ import annotations

import torch

from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from shardkit.sparse import KeyedJaggedTensor

# keys c, a, b; batch 2: c [[1], [2]], a [[3], [4, 5]], b [[6], []]
KJT = KeyedJaggedTensor.from_lengths_sync(
    ["c", "a", "b"], torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([1, 1, 1, 2, 1, 0])
)
A_BAGS, B_BAGS = [[3], [4, 5]], [[6], []]


def _shared_tables(config_type, **kwargs):
    # "a" is looked up by t1 (width 2) and t2 (width 3 for bags, 2 for sequences: one group)
    return [
        config_type(name="t1", embedding_dim=2, num_embeddings=10, feature_names=["a", "b"], **kwargs),
        config_type(
            name="t2",
            embedding_dim=3 if config_type is EmbeddingBagConfig else 2,
            num_embeddings=10,
            feature_names=["a"],
            **kwargs,
        ),
    ]


def _pooled(weight, bags):
    return torch.stack([weight[bag].sum(0) if bag else weight.new_zeros(weight.shape[1]) for bag in bags])


def test_ebc_ignores_unused_features_and_names_shared_ones_feature_at_table():
    ebc = EmbeddingBagCollection(_shared_tables(EmbeddingBagConfig))
    out = ebc(KJT)
    assert out.keys() == ["a@t1", "b", "a@t2"]
    assert out.length_per_key() == [2, 2, 3]
    w1, w2 = ebc.embedding_bags["t1"].weight, ebc.embedding_bags["t2"].weight
    result = out.to_dict()
    torch.testing.assert_close(result["a@t1"], _pooled(w1, A_BAGS))
    torch.testing.assert_close(result["b"], _pooled(w1, B_BAGS))
    torch.testing.assert_close(result["a@t2"], _pooled(w2, A_BAGS))
    assert [t.name for t in ebc.embedding_bag_configs()] == ["t1", "t2"]


def test_ec_names_shared_features_the_same_way():
    ec = EmbeddingCollection(_shared_tables(EmbeddingConfig), need_indices=True)
    out = ec(KJT)
    assert list(out) == ["a@t1", "b", "a@t2"]
    w1, w2 = ec.embeddings["t1"].weight, ec.embeddings["t2"].weight
    torch.testing.assert_close(out["a@t1"].values(), w1[[3, 4, 5]])
    torch.testing.assert_close(out["a@t2"].values(), w2[[3, 4, 5]])
    torch.testing.assert_close(out["b"].values(), w1[[6]])
    assert out["a@t2"].lengths().tolist() == [1, 2] and out["a@t2"].weights().tolist() == [3, 4, 5]


def test_one_kjt_feeds_an_ebc_and_an_ec_on_different_features():
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=10, feature_names=["c"])]
    )
    ec = EmbeddingCollection(
        [EmbeddingConfig(name="s", embedding_dim=2, num_embeddings=10, feature_names=["b"])]
    )
    assert ebc(KJT).keys() == ["c"] and list(ec(KJT)) == ["b"]


def test_table_views_are_the_tables_rows_and_not_parameters():
    ebc = EmbeddingBagCollection(_shared_tables(EmbeddingBagConfig))
    assert list(ebc.embedding_bags) == ["t1", "t2"]
    view = ebc.embedding_bags["t2"]
    assert (view.num_embeddings, view.embedding_dim) == (10, 3)
    with torch.no_grad():
        view.weight.fill_(0.5)  # writes the table
    assert torch.equal(ebc.state_dict()["embedding_bags.t2.weight"], torch.full((10, 3), 0.5))
    names = [n for n, _ in ebc.named_parameters()]
    assert not any(n.startswith("embedding_bags") for n in names)
    assert list(ebc.state_dict()) == ["embedding_bags.t1.weight", "embedding_bags.t2.weight"]
    assert ebc.device == torch.device("cpu")
    meta = EmbeddingCollection(_shared_tables(EmbeddingConfig), device=torch.device("meta"))
    assert meta.device.type == "meta" and meta.embeddings["t1"].weight.is_meta


def test_torchrec_import_paths():
    import shardkit
    from shardkit.modules import embedding_modules

    assert shardkit.EmbeddingBagCollection is EmbeddingBagCollection
    assert shardkit.KeyedJaggedTensor is KeyedJaggedTensor
    assert embedding_modules.EmbeddingCollection is EmbeddingCollection
    assert embedding_modules.get_embedding_names_by_table(_shared_tables(EmbeddingBagConfig)) == [
        ["a@t1", "b"],
        ["a@t2"],
    ]
    from shardkit import DistributedModelParallel  # noqa: F401 - the import itself is the check
