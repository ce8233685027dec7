"""Zero-sample batches (a KJT of stride 0, e.g. the last batch of an epoch) on any subset of ranks.

Every sharded module equals its unsharded module on the same global batch when some ranks (or all)
have no samples: pooled (EBC, position-weighted FP-EBC, MC-EBC, quantized EBC) and sequence (EC,
MC-EC), with one table per sharding type (data-parallel, table-wise, row-wise, column-wise,
table-row-wise, table-column-wise, grid), checking forward values, input-weight gradients and the
weights (and MC maps) after fused optimizer steps. The empty ranks vary; one ``run_world`` per world
size runs every pattern (worker processes are reused). Issue 23, docs/reliability.md.
"""

from __future__ import annotations

import copy
from typing import List, Sequence

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.codecs import CommType, QCommsConfig, get_qcomm_codecs
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FeatureProcessedEmbeddingBagCollection,
    FusedOptimizerConfig,
    OptimType,
    PoolingType,
    PositionWeightedModule,
)
from shardkit.quant import QuantEmbeddingBagCollection, QuantFeatureProcessedEmbeddingBagCollection
from shardkit.sharding import EmbeddingBagSharder, EmbeddingModuleShardingPlan
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from shardkit.sharding.quant_embeddingbag import (
    QuantEmbeddingBagCollectionSharder,
    QuantFeatureProcessedEmbeddingBagCollectionSharder,
)
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, grid_shard, table_wise
from shardkit.sharding.types import CommOp
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case
from tests.sharding import test_mc_sharded as mc
from tests.sharding import test_quant_embeddingbag as quant
from tests.sharding import test_sharded_embedding_bag as plain

TOL = dict(rtol=1e-5, atol=1e-6)
FP8_TOL = dict(rtol=0.07, atol=0.02)
FP8_WEIGHT_TOL = dict(rtol=0.0, atol=0.02)
# (table, rows, dim, features, pooling): the shared tables plus a grid-sharded one
TABLES = case.TABLES + [("t_grid", 9, 6, ["f_grid"], PoolingType.SUM)]
FEATURES = [(f, rows) for _, rows, _, feats, _ in TABLES for f in feats]
# the data-parallel table is stepped by plain SGD (case.average_dense_gradients_): SGD modules only
NO_DP_FEATURES = [(f, rows) for f, rows in FEATURES if f != "f_dp"]
# which ranks have zero samples, per world size: each single rank, a pair, and all of them
EMPTY = {2: [(0,), (1,), (0, 1)], 3: [(0,), (1,), (2,), (0, 2), (0, 1, 2)]}


def _generators():
    _, world_size, local_size = case.world()
    gens = case.plan_generators(world_size, local_size, with_dp=True)
    gens["t_grid"] = grid_shard(host_indexes=range(world_size // local_size))
    return gens


def _configs(config_type, pooled: bool, with_dp: bool = True):
    return [
        config_type(rows, dim, name=name, feature_names=feats, **({"pooling": pooling} if pooled else {}))
        for name, rows, dim, feats, pooling in TABLES
        if (with_dp or name != "t_dp") and (pooled or name != "t_grid")  # EC: no grid (as torchrec)
    ]


def _ebc(optimizer: OptimType, weighted: bool) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        _configs(EmbeddingBagConfig, True, with_dp=optimizer is OptimType.SGD),
        is_weighted=weighted,
        fused_optimizer=FusedOptimizerConfig(optimizer, lr=case.LR),
    )


def _plan(module):
    _, world_size, local_size = case.world()
    configs = (
        module.embedding_bag_configs()
        if hasattr(module, "embedding_bag_configs")
        else module.embedding_configs()
    )
    names = {c.name for c in configs}
    gens = {name: gen for name, gen in _generators().items() if name in names}
    return construct_module_sharding_plan(module, gens, local_size, world_size)


def _assert_same_shards(sharded, reference_ebc) -> None:
    for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
        torch.testing.assert_close(
            weight, reference_ebc.table_weight(name)[r0:r1, c0:c1].detach(), **TOL, msg=name
        )


def _check_ebc(
    empty: Sequence[int], optimizer: OptimType, weighted: bool, fp8: bool = False, unused: Sequence[int] = ()
) -> None:
    """``fp8``: fp8 comm codecs on the pooled all-to-all and reduce-scatter (forward and backward):
    within fp8 rounding (3 mantissa bits: a relative error up to 1/16 per value sent)."""
    reference = _ebc(optimizer, weighted)
    registry = None
    if fp8:
        codecs = get_qcomm_codecs(QCommsConfig(CommType.FP8, CommType.FP8, fp8_block_size=4))
        registry = {
            CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value: codecs,
            CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value: codecs,
        }
    sharded = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry).shard(
        copy.deepcopy(reference), _plan(reference), ShardingEnv.from_process_group(None)
    )
    features = FEATURES if optimizer is OptimType.SGD else NO_DP_FEATURES
    tol = FP8_TOL if fp8 else TOL
    case.train_and_compare(reference, sharded, features, weighted, tol, empty, unused)
    for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
        want = reference.table_weight(name)[r0:r1, c0:c1].detach()
        torch.testing.assert_close(weight, want, **(FP8_WEIGHT_TOL if fp8 else TOL), msg=name)


def _check_ec(empty: Sequence[int], unused: Sequence[int] = ()) -> None:
    rank, world_size, _ = case.world()
    torch.manual_seed(0)
    reference = EmbeddingCollection(
        _configs(EmbeddingConfig, False),
        need_indices=True,
        fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=case.LR),
    )
    sharded = EmbeddingCollectionSharder().shard(
        copy.deepcopy(reference), _plan(reference), ShardingEnv.from_process_group(None)
    )
    for step in range(case.STEPS):
        features = [(f, rows) for f, rows in FEATURES if f != "f_grid"]
        global_kjt, local_kjt, sizes = case.global_and_local(
            step, rank, world_size, features, False, empty, unused
        )
        expected = reference(global_kjt)
        out = sharded(local_kjt)
        assert list(out.keys()) == list(expected.keys())
        loss, expected_loss = 0, 0
        for i, (name, jt) in enumerate(expected.items()):
            lengths = jt.lengths().tolist()
            mine = case.my_rows(rank, sizes)
            rows = slice(sum(lengths[: mine.start]), sum(lengths[: mine.stop]))
            got = out[name]
            assert got.lengths().tolist() == local_kjt[name].lengths().tolist()
            torch.testing.assert_close(got.values(), jt.values()[rows].detach(), **TOL, msg=name)
            grad = torch.randn(jt.values().shape, generator=torch.Generator().manual_seed(10 * step + i))
            expected_loss = expected_loss + (jt.values() * grad).sum()
            loss = loss + (got.values() * grad[rows]).sum()
        (expected_loss / world_size).backward()
        loss.backward()
        case.average_dense_gradients_(sharded, world_size)
    _assert_same_shards(sharded, reference)


def _vbe_generators(pooled: bool):
    """The sharding types a variable batch per feature supports (row-wise MEAN and row-wise tables
    with fewer rows than ranks are refused for pooled lookups: table-wise here)."""
    _, world_size, _ = case.world()
    gens = _generators()
    if pooled:
        gens["t_twrw"] = table_wise(rank=0)
        gens["t_twcw"] = gens["t_cw"]
        gens["t_rw_small"] = table_wise(rank=world_size - 1)
        gens["t_rw_mean"] = table_wise(rank=0)
        gens["t_twrw_mean"] = table_wise(rank=world_size - 1)
        gens["t_grid"] = table_wise(rank=world_size - 1)
    return gens


def _check_vbe(empty: Sequence[int], pooled: bool) -> None:
    """A variable batch per feature (stride per key per rank, inverse indices) with empty ranks."""
    rank, world_size, local_size = case.world()
    torch.manual_seed(0)
    optimizer = FusedOptimizerConfig(OptimType.SGD, lr=case.LR)
    if pooled:
        reference = EmbeddingBagCollection(_configs(EmbeddingBagConfig, True), fused_optimizer=optimizer)
        sharder = EmbeddingBagCollectionSharder()
    else:
        reference = EmbeddingCollection(_configs(EmbeddingConfig, False), fused_optimizer=optimizer)
        sharder = EmbeddingCollectionSharder()
    configs = reference.embedding_bag_configs() if pooled else reference.embedding_configs()
    gens = {c.name: _vbe_generators(pooled)[c.name] for c in configs}
    plan = construct_module_sharding_plan(reference, gens, local_size, world_size)
    sharded = sharder.shard(copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None))
    features = [(f, rows) for f, rows in FEATURES if pooled or f != "f_grid"]
    sizes = [case.batch_size(r, empty) for r in range(world_size)]
    for step in range(case.STEPS):
        global_kjt, local_kjt, _ = case.variable_batch(step, rank, world_size, features, sizes)
        expected = reference(global_kjt)
        out = sharded(local_kjt)
        gen = torch.Generator().manual_seed(step)
        if pooled:
            mine = case.my_rows(rank, sizes)
            assert out.values().shape == (sizes[rank], expected.values().shape[1])
            torch.testing.assert_close(out.values(), expected.values()[mine].detach(), **TOL)
            grad = torch.randn(expected.values().shape, generator=gen)
            expected_loss, loss = (expected.values() * grad).sum(), (out.values() * grad[mine]).sum()
        else:
            expected_loss, loss = 0, 0
            for name, jt in expected.items():
                bags = global_kjt.stride_per_key_per_rank()[global_kjt.keys().index(name)]
                lengths = jt.lengths().tolist()
                start = sum(lengths[: sum(bags[:rank])])
                mine = slice(start, start + sum(lengths[sum(bags[:rank]) : sum(bags[: rank + 1])]))
                torch.testing.assert_close(out[name].values(), jt.values()[mine].detach(), **TOL)
                grad = torch.randn(jt.values().shape, generator=gen)
                expected_loss = expected_loss + (jt.values() * grad).sum()
                loss = loss + (out[name].values() * grad[mine]).sum()
        (expected_loss / world_size).backward()
        loss.backward()
        case.average_dense_gradients_(sharded, world_size)
    _assert_same_shards(sharded, reference)


PROCESSED = ["f_tw", "f_cw1", "f_rw", "f_dp", "f_twrw", "f_twcw", "f_grid"]


def _check_fp_ebc(empty: Sequence[int], unused: Sequence[int] = ()) -> None:
    """Position weights: forward, the position weights' gradient (summed over ranks), table weights."""
    rank, world_size, _ = case.world()
    reference = FeatureProcessedEmbeddingBagCollection(
        _ebc(OptimType.SGD, weighted=True), {f: PositionWeightedModule(4) for f in PROCESSED}
    )
    for f in PROCESSED:
        with torch.no_grad():
            reference._feature_processors[f].position_weight.uniform_(0.5, 1.5)
    plan = _plan(reference.embedding_bag_collection)
    sharded = FeatureProcessedEmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None)
    )
    for step in range(case.STEPS):
        global_kjt, local_kjt, sizes = case.global_and_local(
            step, rank, world_size, FEATURES, True, empty, unused
        )
        expected = reference(global_kjt)
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        (expected.values() * grad).sum().div(world_size).backward()
        out = sharded(local_kjt)
        mine = case.my_rows(rank, sizes)
        assert out.values().shape == (sizes[rank], expected.values().shape[1])
        torch.testing.assert_close(out.values(), expected.values()[mine].detach(), **TOL)
        (out.values() * grad[mine]).sum().backward()
        for f in PROCESSED:
            weight = sharded._feature_processors[f].position_weight
            mine_grad = torch.zeros_like(weight) if weight.grad is None else weight.grad
            dist.all_reduce(mine_grad)
            want = reference._feature_processors[f].position_weight.grad
            torch.testing.assert_close(mine_grad, torch.zeros_like(weight) if want is None else want, **TOL)
            weight.grad = None
            reference._feature_processors[f].position_weight.grad = None
        case.average_dense_gradients_(sharded, world_size)
    _assert_same_shards(sharded, reference.embedding_bag_collection)


def _check_mc(empty: Sequence[int], pooled: bool, unused: Sequence[int] = ()) -> None:
    """MC-EBC / MC-EC (row-wise, table-wise, column-wise tables): remaps, evictions, outputs, state."""
    rank, world_size, _ = case.world()
    reference = mc.build(pooled, world_size, equivalent=True)
    sharded = mc.shard(mc.build(pooled, world_size, equivalent=False), world_size)
    keys = [f for _, _, feats, *_ in mc.TABLES.values() for f in feats]
    for step in range(4):
        per_rank = [{f: [] for f in keys} if r in empty else mc.rank_bags(step, r) for r in range(world_size)]
        sizes = [case.batch_size(r, empty) for r in range(world_size)]
        global_kjt = case.to_kjt({f: [b for r in range(world_size) for b in per_rank[r][f]] for f in keys})
        local_kjt = case.to_kjt({f: per_rank[rank][f] for f in reversed(keys)})
        if rank in unused:
            local_kjt = case.with_unused_feature(local_kjt)
        assert local_kjt.stride() == sizes[rank]
        expected, expected_remap = reference(global_kjt)
        out, remapped = sharded(local_kjt)
        mine = case.my_rows(rank, sizes)
        for key in keys:
            assert mc.bags_of(remapped, key, slice(None)) == mc.bags_of(expected_remap, key, mine), key
        gen = torch.Generator().manual_seed(step)
        if pooled:
            assert out.values().shape == (sizes[rank], expected.values().shape[1])
            torch.testing.assert_close(out.values(), expected.values()[mine].detach(), **TOL)
            grad = torch.randn(expected.values().shape, generator=gen)
            loss_ref, loss = (expected.values() * grad).sum(), (out.values() * grad[mine]).sum()
        else:
            loss_ref, loss = 0.0, 0.0
            for key in keys:
                jt, want = out[key], expected[key]
                offsets = want.offsets().tolist()
                rows = slice(offsets[mine.start], offsets[mine.stop])
                grad = torch.randn(want.values().shape, generator=gen)
                torch.testing.assert_close(jt.values(), want.values()[rows].detach(), **TOL)
                loss_ref = loss_ref + (want.values() * grad).sum()
                loss = loss + (jt.values() * grad[rows]).sum()
        loss_ref.div(world_size).backward()
        loss.backward()
    mc.check_state(reference, sharded)


def _check_quant(empty: Sequence[int], processed: bool, unused: Sequence[int] = ()) -> None:
    """Quantized tables (int8 / int4 / int2 / fp16 / bf16 / fp32; table-, row-, column-wise), inference;
    ``processed``: position weights in front (the quantized FP-EBC)."""
    rank, world_size, _ = case.world()
    env = ShardingEnv.from_process_group(None)
    if processed:
        torch.manual_seed(0)
        processors = {"a": PositionWeightedModule(4), "c": PositionWeightedModule(4)}
        for p in processors.values():
            with torch.no_grad():
                p.position_weight.uniform_(0.5, 1.5)
        reference = QuantFeatureProcessedEmbeddingBagCollection.from_float(
            FeatureProcessedEmbeddingBagCollection(quant._trained(True), processors)
        )
        plan = quant.plan_of(reference.embedding_bag_collection, world_size)
        sharded = QuantFeatureProcessedEmbeddingBagCollectionSharder().shard(
            copy.deepcopy(reference), plan, env
        )
    else:
        reference = QuantEmbeddingBagCollection.from_float(quant._trained(True))
        plan = quant.plan_of(reference, world_size)
        sharded = QuantEmbeddingBagCollectionSharder().shard(copy.deepcopy(reference), plan, env)
    for step in range(2):
        global_kjt, local_kjt, sizes = case.global_and_local(
            step, rank, world_size, quant.FEATURES, True, empty, unused
        )
        expected = reference(global_kjt)
        out = sharded(local_kjt)
        assert out.keys() == expected.keys()
        assert out.values().shape == (sizes[rank], expected.values().shape[1])
        torch.testing.assert_close(out.values(), expected.values()[case.my_rows(rank, sizes)], **quant.TOL)


def _bag_inputs(bags: List[List[int]], form: str):
    """(input, offsets) of ``bags`` in nn.EmbeddingBag's 1-D or 2-D form (``[0, LENGTH]`` for none)."""
    if not bags:  # (plain._inputs would give offsets [0]: one empty bag)
        none = torch.zeros(0, dtype=torch.int64)
        return (torch.zeros(0, plain.LENGTH, dtype=torch.int64), None) if form == "2d" else (none, none)
    return plain._inputs(bags, form)


def _check_embedding_bag(empty: Sequence[int]) -> None:
    """The sharded plain nn.EmbeddingBag, every sharding type, both input forms, sum and mean."""
    rank, world_size, local_size = case.world()
    env = ShardingEnv.from_process_group(None)
    for sharding_type in plain._generators(world_size, plain.FUSED):
        for mode, kernel in (("sum", plain.DENSE), ("mean", plain.FUSED)):
            torch.manual_seed(0)
            reference = nn.EmbeddingBag(plain.ROWS, plain.DIM, mode=mode)
            fused = kernel == plain.FUSED and sharding_type != "data_parallel"
            sharder = EmbeddingBagSharder(
                fused_params={"optimizer": OptimType.SGD, "learning_rate": plain.LR} if fused else None
            )
            generator = plain._generators(world_size, kernel)[sharding_type]
            sharding = generator("weight", (plain.ROWS, plain.DIM), local_size, world_size, "cpu")
            plan = EmbeddingModuleShardingPlan({"weight": sharding})
            sharded = sharder.shard(copy.deepcopy(reference), plan, env)
            for step, form in enumerate(["1d", "2d"]):
                per_rank = [[] if r in empty else plain._bags(step, r, form) for r in range(world_size)]
                mine = case.my_rows(rank, [len(bags) for bags in per_rank])
                expected = reference(*_bag_inputs([b for bags in per_rank for b in bags], form))
                grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(100 + step))
                (expected * grad).sum().div(world_size).backward()
                with torch.no_grad():
                    reference.weight.add_(reference.weight.grad, alpha=-plain.LR)
                reference.weight.grad = None
                out = sharded(*_bag_inputs(per_rank[rank], form))
                what = f"{sharding_type} {mode} step {step} ({form})"
                torch.testing.assert_close(
                    out.wait(), expected[mine].detach(), **TOL, msg=lambda m, what=what: f"{what}: {m}"
                )
                (out * grad[mine]).sum().backward()
                plain._step_sgd_(sharded, world_size)
            full = sharded.full_table("weight")
            torch.testing.assert_close(full, reference.weight.detach(), **TOL, msg=sharding_type)


def _worker() -> List[str]:
    _, world_size, _ = case.world()
    done = []
    for empty in EMPTY[world_size]:
        _check_ebc(empty, OptimType.SGD, weighted=False)
        _check_ebc(empty, OptimType.ADAGRAD, weighted=True)
        _check_ebc(empty, OptimType.SGD, weighted=False, fp8=True)
        _check_ec(empty)
        _check_vbe(empty, pooled=True)
        _check_vbe(empty, pooled=False)
        _check_fp_ebc(empty)
        _check_mc(empty, pooled=True)
        _check_mc(empty, pooled=False)
        _check_quant(empty, processed=False)
        _check_quant(empty, processed=True)
        _check_embedding_bag(empty)
        done.append(str(empty))
    return done


# world 2 as two nodes of one rank (grid: a column block per node; table-row-wise and -column-wise on
# one node), world 3 as one node (grid, table-row-wise: row blocks over three ranks)
@pytest.mark.parametrize("world_size, local_size", [(2, 1), (3, None)])
def test_zero_samples_on_any_ranks_match_unsharded(world_size, local_size):
    results = run_world(_worker, world_size, local_world_size=local_size)
    assert results == [[str(e) for e in EMPTY[world_size]]] * world_size


# (ranks with zero samples, ranks whose input has a feature no table looks up); docs/sharding.md
UNUSED_CASES = [((), (1,)), ((0,), (0, 2))]


def _unused_worker() -> List[str]:
    """An input key that no table looks up, on some ranks only (ids outside every table, weights):
    ignored, as torchrec and the unsharded modules do, with every rank's result exact."""
    done = []
    for empty, unused in UNUSED_CASES:
        _check_ebc(empty, OptimType.SGD, weighted=False, unused=unused)
        _check_ebc(empty, OptimType.ADAGRAD, weighted=True, unused=unused)
        _check_ec(empty, unused)
        _check_fp_ebc(empty, unused)
        _check_mc(empty, pooled=True, unused=unused)
        _check_mc(empty, pooled=False, unused=unused)
        _check_quant(empty, processed=False, unused=unused)
        _check_quant(empty, processed=True, unused=unused)
        done.append(str(unused))
    return done


def test_unused_feature_on_some_ranks_is_ignored_exactly():
    assert run_world(_unused_worker, 3) == [[str(u) for _, u in UNUSED_CASES]] * 3
