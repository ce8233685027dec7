"""Grid sharding (torchrec's ``grid_shard``): column blocks, each row-wise over the ranks of one node.

The multi-rank checks compare a ShardedEmbeddingBagCollection holding grid tables (with row-wise and
table-wise tables beside them) with the unsharded collection on the global batch: forward values,
the gradients of the input's per-id weights, and the weights after fused SGD / Adagrad / Adam steps;
then a dcp checkpoint of a grid plan (row-wise Adagrad state included) loads into another grid
module and into a row-wise one. Worlds: 2 nodes of 1 rank, 3 nodes of 1 rank (grid over nodes 2 and
0, node 1 holding none of it), 2 nodes of 2 ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimizerConfig,
    OptimType,
    PoolingType,
)
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embedding_sharding import sharded_table
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import (
    build_parameter_sharding,
    construct_module_sharding_plan,
    grid_shard,
    row_wise,
    table_wise,
)
from shardkit.sharding.state_layout import row_state_layout
from shardkit.sharding.types import ShardingType
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-6)

# (table, rows, dim, features, pooling); "g1" is also looked up by t_tw (outputs g1@g_sum, g1@t_tw)
TABLES = [
    ("g_sum", 11, 7, ["g1", "g2"], PoolingType.SUM),
    ("g_mean", 9, 5, ["g_mean"], PoolingType.MEAN),
    ("g_uneven", 5, 9, ["g_uneven"], PoolingType.SUM),
    ("t_rw", 13, 4, ["f_rw"], PoolingType.SUM),
    ("t_tw", 6, 3, ["g1"], PoolingType.SUM),
]
FEATURES = [("g1", 6), ("g2", 11), ("g_mean", 9), ("g_uneven", 5), ("f_rw", 13)]


def _ebc(seed: int, optimizer: OptimType, weighted: bool = False) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(rows, dim, name=name, feature_names=feats, pooling=pooling)
        for name, rows, dim, feats, pooling in TABLES
    ]
    return EmbeddingBagCollection(
        tables, is_weighted=weighted, fused_optimizer=FusedOptimizerConfig(optimizer, lr=case.LR)
    )


def _generators(grid_tables: bool = True):
    _, world_size, local_size = case.world()
    hosts = list(range(world_size // local_size))
    first_and_last = sorted({hosts[-1], hosts[0]}, reverse=True)  # blocks in reverse node order
    uneven = [6, 3] if len(first_and_last) == 2 else [9]
    gens = {
        "g_sum": grid_shard(host_indexes=hosts),
        "g_mean": grid_shard(host_indexes=first_and_last),
        "g_uneven": grid_shard(host_indexes=first_and_last, sizes=uneven),
        "t_rw": row_wise(),
        "t_tw": table_wise(rank=world_size - 1),
    }
    if not grid_tables:
        gens.update({name: row_wise() for name in ("g_sum", "g_mean", "g_uneven")})
    return gens


def _plan(module: EmbeddingBagCollection, grid_tables: bool = True):
    _, world_size, local_size = case.world()
    plan = construct_module_sharding_plan(module, _generators(grid_tables), local_size, world_size)
    if grid_tables:
        assert plan["g_sum"].sharding_type == ShardingType.GRID_SHARD.value
    return plan


def _shard(module: EmbeddingBagCollection, grid_tables: bool = True):
    plan = _plan(module, grid_tables)
    return EmbeddingBagCollectionSharder().shard(module, plan, ShardingEnv.from_process_group(None))


def _check_exact(optimizer: OptimType, weighted: bool) -> None:
    rank, world_size, _ = case.world()
    reference = _ebc(0, optimizer, weighted)
    sharded = _shard(copy.deepcopy(reference))
    case.train_and_compare(reference, sharded, FEATURES, weighted, TOL)
    shards = sharded.local_shards()
    # this rank holds exactly the grid blocks the plan gives it (a row block of one column block)
    planned = {
        (
            name,
            s.shard_offsets[0],
            s.shard_offsets[0] + s.shard_sizes[0],
            s.shard_offsets[1],
            s.shard_offsets[1] + s.shard_sizes[1],
        )
        for name, ps in _plan(reference).items()
        if ps.sharding_type == "grid_shard"
        for s in ps.sharding_spec.shards
        if s.rank == rank and s.shard_sizes[0] > 0
    }
    assert {key for key in shards if key[0].startswith("g_")} == planned
    for (name, r0, r1, c0, c1), weight in shards.items():
        torch.testing.assert_close(weight, reference.table_weight(name)[r0:r1, c0:c1].detach(), **TOL)
    for name, *_ in TABLES:
        torch.testing.assert_close(sharded.full_table(name), reference.table_weight(name).detach(), **TOL)


def _train_step(sharded, step: int) -> torch.Tensor:
    rank, world_size, _ = case.world()
    _, local_kjt, _ = case.global_and_local(step, rank, world_size, FEATURES, weighted=False)
    out = sharded(local_kjt).values()
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + step))).sum().backward()
    return out.detach()


def _check_checkpoint(path: str) -> None:
    """Tables and row-wise Adagrad state (one accumulator per row and column block) round trip."""
    trained = _shard(_ebc(0, OptimType.ROWWISE_ADAGRAD))
    for step in range(2):
        _train_step(trained, step)
    saved_full = {name: trained.full_table(name) for name, *_ in TABLES}
    dcp.save(
        {"model": trained.state_dict(), "optim": trained.fused_optimizer.state_dict()}, checkpoint_id=path
    )

    fresh = _shard(_ebc(1, OptimType.ROWWISE_ADAGRAD))
    state = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    fresh.fused_optimizer.load_state_dict(state["optim"])
    before = trained.local_shards()
    assert all(torch.equal(before[k], v) for k, v in fresh.local_shards().items())
    # the state came back too: one more step keeps both modules equal
    assert torch.equal(_train_step(trained, 2), _train_step(fresh, 2))
    after = trained.local_shards()
    assert all(torch.equal(after[k], v) for k, v in fresh.local_shards().items())

    # the grid tables' values load into row-wise shards of the same tables (a resharded checkpoint)
    row_split = _shard(_ebc(2, OptimType.SGD), grid_tables=False)
    model = row_split.state_dict()
    dcp.load({"model": model}, checkpoint_id=path)
    row_split.load_state_dict(model)
    for name, *_ in TABLES:
        assert torch.equal(row_split.full_table(name), saved_full[name]), name


def _worker(path: str) -> bool:
    for optimizer in (OptimType.SGD, OptimType.ADAGRAD, OptimType.ADAM):
        _check_exact(optimizer, weighted=False)
    _check_exact(OptimType.SGD, weighted=True)
    _check_checkpoint(path)
    return True


@pytest.mark.parametrize("world_size, local_size", [(2, 1), (3, 1), (4, 2)])
def test_grid_matches_unsharded_and_checkpoints(world_size, local_size, tmp_path):
    assert all(run_world(_worker, world_size, str(tmp_path), local_world_size=local_size))


# --- plans and placement checks (no process group) ---


def test_grid_shard_plan_blocks_per_host_rows_per_local_rank():
    plan = grid_shard(host_indexes=[1, 0])("t", (10, 7), 2, 4, "cpu")
    assert plan.sharding_type == "grid_shard"
    assert plan.ranks == [2, 3, 0, 1]
    shards = [(s.shard_offsets, s.shard_sizes, s.placement) for s in plan.sharding_spec.shards]
    assert shards == [
        ([0, 0], [5, 4], "rank:2/cpu"),
        ([5, 0], [5, 4], "rank:3/cpu"),
        ([0, 4], [5, 3], "rank:0/cpu"),
        ([5, 4], [5, 3], "rank:1/cpu"),
    ]
    uneven = grid_shard([0, 1], sizes=[2, 5])("t", (3, 7), 2, 4, "cuda")
    assert [(s.shard_offsets, s.shard_sizes) for s in uneven.sharding_spec.shards] == [
        ([0, 0], [2, 2]),
        ([2, 0], [1, 2]),
        ([0, 2], [2, 5]),
        ([2, 2], [1, 5]),
    ]
    assert uneven.sharding_spec.shards[1].placement == "rank:1/cuda:1"


@pytest.mark.parametrize(
    "make, shape, words",
    [
        (lambda: grid_shard([0, 0]), (4, 4), "distinct host indexes"),
        (lambda: grid_shard([0, 2]), (4, 4), "host_index 2 is out of range"),
        (lambda: grid_shard([0, 1]), (4, 1), "cannot split 1 columns into 2"),
        (lambda: grid_shard([0, 1], sizes=[4]), (4, 4), "1 column sizes"),
        (lambda: grid_shard([0, 1], sizes=[1, 2]), (4, 4), "add up to the table's 4 columns"),
    ],
)
def test_grid_shard_plan_errors_name_the_problem(make, shape, words):
    with pytest.raises(ValueError, match=words):
        make()("t", shape, 2, 4, "cpu")


def test_a_rank_holding_two_grid_blocks_is_rejected():
    config = EmbeddingBagConfig(4, 4, name="t", feature_names=["f"])
    sharding = build_parameter_sharding("grid_shard", (4, 4), [0, 1, 0, 1], local_size=2)
    with pytest.raises(ValueError, match="a rank holds two grid_shard blocks"):
        sharded_table(config, sharding, 2)


def test_row_wise_adagrad_state_layout_of_a_grid():
    sharding = grid_shard([0, 1])("t", (5, 6), 2, 4, "cpu")
    layout = row_state_layout("t", sharding, (5, 6), 4)
    assert layout.global_shape == (5, 2) and layout.per_block
    assert [(s.shard_offsets, s.shard_sizes, s.rank) for s in layout.shards] == [
        ([0, 0], [3, 1], 0),
        ([3, 0], [2, 1], 1),
        ([0, 1], [3, 1], 2),
        ([3, 1], [2, 1], 3),
    ]


def test_grid_is_for_pooled_tables_only():
    assert "grid_shard" in EmbeddingBagCollectionSharder().sharding_types("cpu")
    assert "grid_shard" not in EmbeddingCollectionSharder().sharding_types("cpu")
    ec = EmbeddingCollection([EmbeddingConfig(4, 4, name="t", feature_names=["f"])])
    plan = construct_module_sharding_plan(ec, {"t": grid_shard([0])}, 1, 1)
    with pytest.raises(ValueError, match="cannot shard table.*grid_shard"):
        EmbeddingCollectionSharder().shard(ec, plan, ShardingEnv.from_local(1, 0))
