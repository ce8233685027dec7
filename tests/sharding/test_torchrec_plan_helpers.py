"""The sharding-plan helpers with torchrec's defaults and keywords, ``ShardingPlan.__str__`` in
torchrec's layout, ``get_module_to_default_sharders`` and ``apply_to_all``."""

from __future__ import annotations

import pytest
import torch

from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    FeatureProcessedEmbeddingBagCollection,
)
from shardkit.optim import RowWiseAdagrad, apply_optimizer_in_backward
from shardkit.sharding.default_sharders import get_module_to_default_sharders
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import (
    apply_to_all,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from shardkit.sharding.types import ShardingPlan


def _ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
        EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=6, feature_names=["b"]),
    ]
    return EmbeddingBagCollection(tables, device=torch.device("meta"))


def test_default_kernel_follows_the_optimizer_in_backward():
    gens = {"t1": table_wise(rank=1), "t2": row_wise()}
    plain = construct_module_sharding_plan(_ebc(), gens, local_size=2, world_size=2)
    assert {ps.compute_kernel for ps in plain.values()} == {"dense"}
    trained = _ebc()
    apply_optimizer_in_backward(RowWiseAdagrad, trained.parameters(), {"lr": 0.1})
    fused = construct_module_sharding_plan(
        trained, {**gens, "t1": data_parallel()}, local_size=2, world_size=2
    )
    # data-parallel too (issue 23): its fused optimizer steps on the all-reduced gradient (torchrec: dense)
    assert (fused["t1"].compute_kernel, fused["t2"].compute_kernel) == ("fused", "fused")
    explicit = construct_module_sharding_plan(_ebc(), {"t2": row_wise(compute_kernel="fused")}, world_size=2)
    assert explicit["t2"].compute_kernel == "fused"


def test_plan_prints_as_torchrec():
    plan = construct_module_sharding_plan(
        _ebc(), {"t1": table_wise(rank=1), "t2": row_wise()}, local_size=2, world_size=2, device_type="cpu"
    )
    assert str(ShardingPlan({"ebc": plan})) == (
        "module: ebc\n\n"
        "param | sharding type | compute kernel | ranks \n"
        "----- | ------------- | -------------- | ------\n"
        "t1    | table_wise    | dense          | [1]   \n"
        "t2    | row_wise      | dense          | [0, 1]\n\n"
        "param | shard offsets | shard sizes | placement \n"
        "----- | ------------- | ----------- | ----------\n"
        "t1    | [0, 0]        | [10, 4]     | rank:1/cpu\n"
        "t2    | [0, 0]        | [3, 8]      | rank:0/cpu\n"
        "t2    | [3, 0]        | [3, 8]      | rank:1/cpu"
    )


def test_plan_headers_are_centred_as_torchrec():
    table = EmbeddingBagConfig(name="user_id", embedding_dim=4, num_embeddings=8, feature_names=["u"])
    ebc = EmbeddingBagCollection([table], device=torch.device("meta"))
    plan = construct_module_sharding_plan(ebc, {"user_id": table_wise(rank=0)}, world_size=1)
    lines = str(ShardingPlan({"ebc": plan})).splitlines()
    # header cells centred in their column (torchrec pads " param  "), body cells left-aligned
    assert lines[2] == " param  | sharding type | compute kernel | ranks"
    assert lines[4] == "user_id | table_wise    | dense          | [0]  "
    assert lines[6] == " param  | shard offsets | shard sizes | placement "


def _placements(ps):
    return [(s.shard_offsets, s.shard_sizes, s.placement) for s in ps.sharding_spec.shards]


def test_torchrec_keywords_of_the_helpers():
    gens = {
        "t1": table_wise(rank=1, device="cpu"),
        "t2": row_wise(sizes_placement=([2, 4], ["cuda", "cpu"])),
    }
    plan = construct_module_sharding_plan(_ebc(), gens, local_size=2, world_size=2, device_type="cuda")
    assert _placements(plan["t1"]) == [([0, 0], [10, 4], "rank:1/cpu")]
    assert _placements(plan["t2"]) == [([0, 0], [2, 8], "rank:0/cuda:0"), ([2, 0], [4, 8], "rank:1/cpu")]
    # torchrec's size_per_rank: block i on rank i, the last trimmed to the width (3 + 3 + 2 of 8)
    cw = construct_module_sharding_plan(_ebc(), {"t2": column_wise(size_per_rank=[3, 3, 4])}, world_size=3)
    assert [(o, s) for o, s, _ in _placements(cw["t2"])] == [
        ([0, 0], [6, 3]),
        ([0, 3], [6, 3]),
        ([0, 6], [6, 2]),
    ]
    assert cw["t2"].ranks == [0, 1, 2]
    # shardkit's uneven blocks on chosen ranks, through the same keywords, with a device per block
    uneven = column_wise(ranks=[1, 0], size_per_rank=[5, 3], device_types=["cpu", "cuda"])
    cw = construct_module_sharding_plan(
        _ebc(), {"t2": uneven}, local_size=2, world_size=2, device_type="cuda"
    )
    assert _placements(cw["t2"]) == [([0, 0], [6, 5], "rank:1/cpu"), ([0, 5], [6, 3], "rank:0/cuda:0")]
    with pytest.raises(ValueError, match="do not cover its 8 columns"):
        construct_module_sharding_plan(_ebc(), {"t2": column_wise(size_per_rank=[3, 3])}, world_size=2)


def test_default_sharders_and_apply_to_all():
    sharders = get_module_to_default_sharders()
    for module_type in (EmbeddingBagCollection, EmbeddingCollection, FeatureProcessedEmbeddingBagCollection):
        assert sharders[module_type].module_type is module_type
    ebc = _ebc()
    gens = apply_to_all(ebc, row_wise(), EmbeddingBagCollectionSharder())
    assert sorted(gens) == ["t1", "t2"]
    plan = construct_module_sharding_plan(
        ebc, gens, EmbeddingBagCollectionSharder(), 1, 2
    )  # torchrec's order
    assert [ps.ranks for ps in plan.values()] == [[0, 1], [0, 1]]
    with pytest.raises(TypeError, match="EmbeddingCollectionSharder shards EmbeddingCollection"):
        construct_module_sharding_plan(ebc, gens, EmbeddingCollectionSharder())
