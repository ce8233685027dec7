"""Table configs: defaults, dtype mapping and rejection of inconsistent table lists."""

from __future__ import annotations

import math

import pytest
import torch

from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
    data_type_to_dtype,
    group_table_configs,
)


def test_defaults_follow_the_specification():
    config = EmbeddingBagConfig(num_embeddings=100, embedding_dim=8, name="t", feature_names=["f"])
    assert config.pooling is PoolingType.SUM and config.data_type is DataType.FP32
    assert config.get_weight_init_max() == pytest.approx(math.sqrt(0.01))
    assert config.get_weight_init_min() == pytest.approx(-math.sqrt(0.01))
    assert EmbeddingConfig(num_embeddings=3, embedding_dim=2, name="e").pooling is PoolingType.NONE
    assert [data_type_to_dtype(d) for d in DataType] == [torch.float32, torch.float16, torch.bfloat16] + [
        torch.float32  # INT8 / INT4 / INT2 tables train in fp32; shardkit.quant quantizes them
    ] * 3
    assert (
        EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="s", data_type="BF16").dtype
        == torch.bfloat16
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_embeddings=0, embedding_dim=2, name="t"), "must be positive"),
        (dict(num_embeddings=3, embedding_dim=2), "non-empty name"),
        (
            dict(num_embeddings=3, embedding_dim=2, name="t", feature_names=["a", "a"]),
            "declares feature 'a' twice",
        ),
        (dict(num_embeddings=3, embedding_dim=2, name="t", pooling=PoolingType.NONE), "use EmbeddingConfig"),
        (
            dict(num_embeddings=3, embedding_dim=2, name="t", weight_init_min=1.0, weight_init_max=0.0),
            "weight_init_min",
        ),
    ],
)
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EmbeddingBagConfig(**kwargs)


def test_bad_table_lists_raise():
    a = EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="a", feature_names=["f"])
    with pytest.raises(ValueError, match="duplicate table name 'a'"):
        EmbeddingBagCollection(
            [a, EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="a", feature_names=["g"])]
        )
    with pytest.raises(ValueError, match="table 'b' declares feature 'f' twice"):
        EmbeddingBagCollection(
            [a, EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="b", feature_names=["f", "f"])]
        )
    with pytest.raises(ValueError, match="no feature_names"):
        EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="c")])
    with pytest.raises(ValueError, match="at least one table"):
        EmbeddingCollection([])
    with pytest.raises(TypeError, match="expected EmbeddingConfig"):
        EmbeddingCollection([a])


def test_tables_group_by_dim_and_dtype_in_order_of_appearance():
    def table(name, dim, data_type="FP32"):
        return EmbeddingBagConfig(num_embeddings=3, embedding_dim=dim, name=name, data_type=data_type)

    groups = group_table_configs(
        [table("a", 4), table("b", 8), table("c", 4, "FP16"), table("d", 4), table("e", 8)]
    )
    assert [[t.name for t in g] for g in groups] == [["a", "d"], ["b", "e"], ["c"]]
