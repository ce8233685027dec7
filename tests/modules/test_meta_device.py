"""Construction on the meta device, then to_empty + reset_parameters; the initialization rules."""

from __future__ import annotations

import math

import torch

from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimizerConfig,
    PositionWeightedModule,
)
from tests.modules._inputs import random_kjt


def _tables():
    return [
        EmbeddingBagConfig(num_embeddings=400, embedding_dim=8, name="default", feature_names=["f1"]),
        EmbeddingBagConfig(
            num_embeddings=50,
            embedding_dim=8,
            name="ranged",
            feature_names=["f2"],
            weight_init_min=2.0,
            weight_init_max=3.0,
        ),
        EmbeddingBagConfig(
            num_embeddings=20,
            embedding_dim=3,
            name="custom",
            feature_names=["f3"],
            init_fn=torch.nn.init.ones_,
            data_type="BF16",
        ),
    ]


def test_meta_construction_allocates_nothing_until_materialized():
    ebc = EmbeddingBagCollection(
        _tables(), device=torch.device("meta"), fused_optimizer=FusedOptimizerConfig("ADAM")
    )
    assert all(p.is_meta for p in ebc.parameters())
    assert all(b.is_meta for b in ebc.buffers())
    ebc.to_empty(device="cpu")
    ebc.reset_parameters()

    default = ebc.table_weight("default")
    bound = math.sqrt(1 / 400)
    assert default.abs().max() <= bound and default.std() > bound / 4  # uniform(-bound, bound)
    ranged = ebc.table_weight("ranged")
    assert ranged.min() >= 2.0 and ranged.max() <= 3.0
    assert torch.equal(ebc.table_weight("custom"), torch.ones(20, 3, dtype=torch.bfloat16))
    for lookup in ebc.lookups:
        assert lookup.optimizer.step_count == 0
        assert torch.count_nonzero(lookup.optimizer.exp_avg) == 0

    out = ebc(random_kjt({"f1": 400, "f2": 50, "f3": 20}, batch=2))
    out.values().float().sum().backward()
    assert out.values().shape == (2, 19)


def test_meta_collection_loads_a_state_dict():
    source = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=5, embedding_dim=2, name="t", feature_names=["f"])]
    )
    target = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=5, embedding_dim=2, name="t", feature_names=["f"])],
        device=torch.device("meta"),
    )
    target.to_empty(device="cpu")
    target.load_state_dict(source.state_dict())
    assert torch.equal(target.table_weight("t"), source.table_weight("t"))


def test_position_weights_on_meta():
    module = PositionWeightedModule(4, device=torch.device("meta"))
    module.to_empty(device="cpu")
    module.reset_parameters()
    assert torch.equal(module.position_weight.detach(), torch.ones(4))
