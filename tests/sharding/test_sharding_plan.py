"""Plan constructors: the shard metadata of every sharding type covers each table exactly once.

Coverage is checked independently of ``EnumerableShardingSpec.check``: every cell of the table is
counted over the shards, and each shard's placement must be the rank the constructor promised.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig
from shardkit.sharding.sharding_plan import (
    build_parameter_sharding,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    placement,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from shardkit.sharding.types import ParameterSharding, ShardingType

# uneven on purpose: 7 and 13 rows split unevenly at most world sizes, 3 rows leave ranks empty
SHAPES = {"a": (7, 8), "b": (13, 9), "c": (3, 12), "d": (100, 16)}


def _ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(num_embeddings=r, embedding_dim=c, name=n, feature_names=[f"f_{n}"])
        for n, (r, c) in SHAPES.items()
    ]
    return EmbeddingBagCollection(tables, device=torch.device("meta"))


def _assert_tiles(ps: ParameterSharding, shape, world: int) -> None:
    """Every cell of ``shape`` in exactly one shard; shard ranks in range and equal to ``ps.ranks``."""
    if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
        assert ps.sharding_spec is None and ps.ranks == list(range(world))
        return
    count = torch.zeros(shape, dtype=torch.int64)
    for shard in ps.sharding_spec.shards:
        (r0, c0), (nr, nc) = shard.shard_offsets, shard.shard_sizes
        count[r0 : r0 + nr, c0 : c0 + nc] += 1
        assert 0 <= shard.rank < world
    assert torch.equal(count, torch.ones_like(count)), f"{ps.sharding_type}: coverage {count.tolist()}"
    assert ps.ranks == [s.rank for s in ps.sharding_spec.shards]


def _generators(world: int, local: int):
    """One generator per table and sharding type, for a world of ``world`` ranks, ``local`` per node."""
    last = world - 1
    yield "data_parallel", {n: data_parallel() for n in SHAPES}
    yield "table_wise", {n: table_wise(rank=i % world) for i, n in enumerate(SHAPES)}
    yield "row_wise", {n: row_wise() for n in SHAPES}
    uneven = [0] * world
    uneven[last] += 3  # everything on the last rank but the first ranks' share below
    uneven[0] += 4
    yield "row_wise uneven", {"a": row_wise((uneven, "cpu"))}
    yield "column_wise", {n: column_wise(ranks=list(range(min(world, c)))) for n, (_, c) in SHAPES.items()}
    yield "column_wise uneven", {"b": column_wise(ranks=[last, 0], sizes=[2, 7])}
    hosts = world // local
    yield "table_row_wise", {n: table_row_wise(host_index=i % hosts) for i, n in enumerate(SHAPES)}
    yield "table_column_wise", {"d": table_column_wise(host_index=hosts - 1)}


@pytest.mark.parametrize("world", range(1, 9))
def test_every_type_tiles_every_table(world):
    ebc = _ebc()
    locals_ = [d for d in (1, 2, 4) if world % d == 0]
    for local in locals_:
        for label, per_param in _generators(world, local):
            plan = construct_module_sharding_plan(ebc, per_param, local_size=local, world_size=world)
            assert list(plan) == list(per_param), label
            for name, ps in plan.items():
                _assert_tiles(ps, SHAPES[name], world)


def test_row_wise_default_is_array_split():
    plan = construct_module_sharding_plan(_ebc(), {"b": row_wise()}, world_size=4)
    shards = plan["b"].sharding_spec.shards
    assert [s.shard_sizes for s in shards] == [[4, 9], [3, 9], [3, 9], [3, 9]]
    assert [s.shard_offsets for s in shards] == [[0, 0], [4, 0], [7, 0], [10, 0]]
    assert plan["b"].ranks == [0, 1, 2, 3]
    assert plan["b"].compute_kernel == "dense"  # no optimizer in backward: torchrec's default


def test_row_wise_more_ranks_than_rows_leaves_empty_shards():
    plan = construct_module_sharding_plan(_ebc(), {"c": row_wise()}, world_size=5)
    assert [s.shard_sizes[0] for s in plan["c"].sharding_spec.shards] == [1, 1, 1, 0, 0]


def test_table_row_wise_uses_the_ranks_of_one_node():
    plan = construct_module_sharding_plan(
        _ebc(), {"d": table_row_wise(host_index=1)}, local_size=3, world_size=6
    )
    assert plan["d"].ranks == [3, 4, 5]
    assert [s.shard_sizes for s in plan["d"].sharding_spec.shards] == [[34, 16], [33, 16], [33, 16]]


def test_table_column_wise_deals_blocks_round_robin():
    gen = table_column_wise(host_index=0, num_shards=4)
    plan = construct_module_sharding_plan(_ebc(), {"d": gen}, local_size=2, world_size=4)
    assert plan["d"].ranks == [0, 1, 0, 1]
    assert [s.shard_offsets for s in plan["d"].sharding_spec.shards] == [[0, 0], [0, 4], [0, 8], [0, 12]]


def test_placements_name_the_local_device():
    plan = construct_module_sharding_plan(
        _ebc(), {"d": row_wise()}, local_size=2, world_size=4, device_type="cuda"
    )
    assert [s.placement for s in plan["d"].sharding_spec.shards] == [
        "rank:0/cuda:0",
        "rank:1/cuda:1",
        "rank:2/cuda:0",
        "rank:3/cuda:1",
    ]
    assert placement(3, "cpu", 2) == "rank:3/cpu"


def test_row_wise_sizes_placement_overrides_the_device():
    plan = construct_module_sharding_plan(
        _ebc(), {"a": row_wise(([5, 2], "cpu"))}, world_size=2, device_type="cuda"
    )
    assert [s.placement for s in plan["a"].sharding_spec.shards] == ["rank:0/cpu", "rank:1/cpu"]


def test_explicit_kernels():
    plan = construct_module_sharding_plan(
        _ebc(), {"a": data_parallel(), "b": table_wise(0, compute_kernel="dense")}, world_size=2
    )
    assert plan["a"].compute_kernel == "dense" and plan["b"].compute_kernel == "dense"


@pytest.mark.parametrize(
    "per_param, error, match",
    [
        ({"nope": table_wise(0)}, KeyError, "nope"),
        ({"a": table_wise(2)}, ValueError, "outside a world of 2"),
        ({"a": row_wise(([7], "cpu"))}, ValueError, "name 1 ranks"),
        ({"a": row_wise(([3, 3], "cpu"))}, ValueError, "do not add up"),
        ({"a": column_wise(ranks=list(range(9)))}, ValueError, "cannot split 8 columns into 9"),
        ({"a": column_wise(ranks=[0, 1], sizes=[8, 0])}, ValueError, "must be positive"),
        ({"a": table_row_wise(host_index=1)}, ValueError, "host_index 1 is out of range"),
    ],
)
def test_bad_generators_raise_naming_the_table(per_param, error, match):
    with pytest.raises(error, match=match):
        construct_module_sharding_plan(_ebc(), per_param, world_size=2, local_size=2)


def test_local_size_must_divide_world_size():
    with pytest.raises(ValueError, match="does not divide"):
        construct_module_sharding_plan(_ebc(), {"a": row_wise()}, world_size=4, local_size=3)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 50),
    cols=st.integers(1, 20),
    world=st.integers(1, 8),
    kind=st.sampled_from(["row_wise", "table_row_wise", "column_wise", "table_column_wise", "table_wise"]),
)
def test_build_parameter_sharding_tiles(rows, cols, world, kind):
    shards = min(world, cols) if "column" in kind else (1 if kind == "table_wise" else world)
    ranks = list(range(world))[:shards] if kind != "table_wise" else [world - 1]
    ps = build_parameter_sharding(kind, (rows, cols), ranks, world_size=world)
    _assert_tiles(ps, (rows, cols), world)
    ps.check("t", (rows, cols), world)
