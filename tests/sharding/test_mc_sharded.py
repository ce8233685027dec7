"""Sharded MC-EBC / MC-EC against their unsharded equivalent (docs/managed_collision.md) over many steps
with evictions: remapped ids, evictions, outputs, embedding rows, fused optimizer state and the maps;
row-wise (buckets given, and one bucket cut per rank), table-wise and column-wise tables at once, at
world sizes 1-4 (one launch each). Bad input and diverging configurations fail on every rank."""

from __future__ import annotations

import random

import pytest
import torch

from shardkit import checkpoint
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    DistanceLFU_EvictionPolicy,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimizerConfig,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
    OptimType,
)
from shardkit.sharding.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from shardkit.sharding.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 8
BIG = 2**63 - 1


def hash_mod(ids: torch.Tensor, size: int) -> torch.Tensor:
    return torch.remainder(ids, size)


# table: (zch, dim, features, policy, interval, input_hash_size, hash, buckets of the module given)
TABLES = {
    "rw": (48, 4, ["u1", "u2"], lambda: LFU_EvictionPolicy(), 1, BIG, None, 12),
    "rw1": (24, 3, ["v"], lambda: DistanceLFU_EvictionPolicy(), 2, 10**6, None, 1),
    "tw": (10, 4, ["w"], lambda: LRU_EvictionPolicy(), 1, 1000, hash_mod, 1),
    "cw": (9, 6, ["x"], lambda: DistanceLFU_EvictionPolicy(2.0), 1, 3000, None, 3),
}


def build(
    pooled: bool, world_size: int, equivalent: bool, interval_shift: int = 0, rw1_buckets: int = 1, seed=0
):
    """The MC module; ``equivalent``: the unsharded equivalent (one-bucket row-wise modules cut into
    ``world_size`` buckets)."""
    torch.manual_seed(seed)
    config_type = EmbeddingBagConfig if pooled else EmbeddingConfig
    configs, modules = [], {}
    for name, (zch, dim, feats, policy, interval, hash_size, hash_fn, buckets) in TABLES.items():
        configs.append(config_type(zch, dim, name=name, feature_names=feats))
        if name == "rw1":
            buckets = world_size if equivalent and rw1_buckets == 1 else rw1_buckets
        modules[name] = MCHManagedCollisionModule(
            zch, None, policy(), interval + interval_shift, hash_size, hash_fn, name=name, buckets=buckets
        )
    optimizer = FusedOptimizerConfig(OptimType.ADAGRAD, lr=0.1)
    if pooled:
        return ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(configs, fused_optimizer=optimizer),
            ManagedCollisionCollection(modules, configs),
            return_remapped_features=True,
        )
    return ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(configs, fused_optimizer=optimizer),
        ManagedCollisionCollection(modules, configs),
        return_remapped_features=True,
    )


def plan_of(module, world_size: int):
    generators = {
        "rw": row_wise(),
        "rw1": row_wise(),
        "tw": table_wise(rank=world_size - 1),
        "cw": column_wise(ranks=[0, world_size - 1]),
    }
    return construct_module_sharding_plan(module._embedding_module, generators, world_size, world_size)


def shard(module, world_size: int):
    sharder_type = (
        ManagedCollisionEmbeddingBagCollectionSharder
        if isinstance(module, ManagedCollisionEmbeddingBagCollection)
        else ManagedCollisionEmbeddingCollectionSharder
    )
    return sharder_type().shard(module, plan_of(module, world_size), ShardingEnv.from_process_group(None))


def pools():
    rng = random.Random(11)
    return {
        "u1": [rng.randrange(BIG) for _ in range(40)],
        "v": [rng.randrange(10**6) for _ in range(30)],
        "w": [rng.randrange(-(2**40), 2**40) for _ in range(25)],
        "x": [rng.randrange(3000) for _ in range(20)],
    }


def rank_bags(step: int, rank: int):
    """``{feature: [bag of raw ids per sample]}`` of rank ``rank`` at ``step`` (2 + rank samples)."""
    rng, pool = random.Random(1000 * step + rank), pools()
    pool["u2"] = pool["u1"]  # two features of one table share its ids
    out = {}
    for feature, ids in pool.items():
        out[feature] = [
            [
                ids[min(int(rng.expovariate(0.25)), len(ids) - 1)]
                if rng.random() < 0.8
                else rng.choice(ids) + 1
                for _ in range(rng.randrange(0, 4))
            ]
            for _ in range(2 + rank)
        ]
    return out


def bags_of(kjt: KeyedJaggedTensor, key: str, rows: slice):
    jt = kjt[key]
    offsets = jt.offsets().tolist()
    start, stop, _ = rows.indices(len(offsets) - 1)
    return jt.values()[offsets[start] : offsets[stop]].tolist()


def check_equivalent(pooled: bool) -> None:
    _, world_size, _ = case.world()
    reference = build(pooled, world_size, equivalent=True)
    sharded = shard(build(pooled, world_size, equivalent=False), world_size)
    assert run_steps(reference, sharded, range(STEPS)) > 20
    reference.eval()
    sharded.eval()
    run_steps(reference, sharded, range(STEPS, STEPS + 2))  # eval: remap only
    check_state(reference, sharded)


def run_steps(reference, sharded, steps) -> int:
    """Train both on the same global batches; compare each step; returns the evictions seen."""
    rank, world_size, _ = case.world()
    pooled = isinstance(reference, ManagedCollisionEmbeddingBagCollection)
    keys = [f for _, _, feats, *_ in TABLES.values() for f in feats]
    evictions_seen = 0
    for step in steps:
        per_rank = [rank_bags(step, r) for r in range(world_size)]
        global_kjt = case.to_kjt({f: [b for r in range(world_size) for b in per_rank[r][f]] for f in keys})
        local_kjt = case.to_kjt({f: per_rank[rank][f] for f in reversed(keys)})
        expected, expected_remap = reference(global_kjt)
        out, remapped = sharded(local_kjt)
        mine = case.my_rows(rank, [2 + r for r in range(world_size)])
        for key in keys:
            assert bags_of(remapped, key, slice(None)) == bags_of(expected_remap, key, mine), (step, key)
        got_ev = {t: None if s is None else s.tolist() for t, s in sharded.evictions_per_table.items()}
        want_ev = {t: None if s is None else s.tolist() for t, s in reference.evictions_per_table.items()}
        assert got_ev == want_ev, step
        evictions_seen += sum(len(s) for s in want_ev.values() if s is not None)
        gen = torch.Generator().manual_seed(step)
        if pooled:
            grad = torch.randn(expected.values().shape, generator=gen)
            torch.testing.assert_close(out.values(), expected.values()[mine].detach(), **TOL)
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
        if reference.training:
            loss_ref.div(world_size).backward()
            loss.backward()
    return evictions_seen


def check_state(reference, sharded) -> None:
    """Embedding rows, fused optimizer state and the maps of every local shard equal the reference's."""
    ref_ebc = reference._embedding_module
    ref_state = ref_ebc.fused_optimizer.state_dict()["state"]
    for sharded_lookup in sharded._embedding_module.lookups:
        for lookup in sharded_lookup.lookups:
            for i, spec in enumerate(lookup.shards):
                rows, cols = slice(spec.row_start, spec.row_end), slice(spec.col_start, spec.col_end)
                torch.testing.assert_close(
                    lookup.shard_rows(i).detach(),
                    ref_ebc.table_weight(spec.table_name)[rows, cols].detach(),
                    **TOL,
                )
                torch.testing.assert_close(
                    lookup.shard_rows(i, lookup.optimizer.sum),
                    ref_state[spec.table_name]["sum"][rows, cols],
                    **TOL,
                )
    ref_maps = reference._managed_collision_collection._managed_collision_modules
    for name, local in sharded._managed_collision_collection._managed_collision_modules.items():
        start = local._output_global_offset
        for buffer, value in local.named_buffers():
            want = getattr(ref_maps[name], buffer)
            if buffer not in ("_current_iter_tensor", "_buckets_tensor"):
                want = want[start : start + local.output_size()]
            assert torch.equal(value, want), (name, buffer)


def _equivalence_worker() -> bool:
    check_equivalent(pooled=True)
    check_equivalent(pooled=False)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_mc_modules_equal_their_unsharded_equivalent(world_size):
    assert all(run_world(_equivalence_worker, world_size))


def _bad_input_worker() -> bool:
    rank, world_size, _ = case.world()
    sharded = shard(build(True, world_size, equivalent=False), world_size)
    bags = rank_bags(0, rank)
    if rank == 1:
        bags["x"][0] = [-5]  # not hashed: ids must be in [0, 3000)
    case.raises_value_error(lambda: sharded(case.to_kjt(bags)), "rank 1", "'cw'", "-5", "outside [0, 3000)")
    bags = rank_bags(0, rank)
    if rank == 2:
        del bags["w"]
    case.raises_value_error(lambda: sharded(case.to_kjt(bags)), "rank 2", "lacks")
    # after the errors the module still works, on every rank
    out, _ = sharded(case.to_kjt(rank_bags(1, rank)))
    assert out.values().shape[0] == 2 + rank
    # a configuration that differs on one rank
    case.raises_value_error(
        lambda: shard(build(True, world_size, False, interval_shift=int(rank == 0)), world_size), "disagree"
    )
    # zch_size not whole buckets per row block: 10 rows over 3 ranks
    module = build(True, world_size, equivalent=False)
    configs = [EmbeddingBagConfig(10, 2, name="odd", feature_names=["o"])]
    odd = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(configs, fused_optimizer=FusedOptimizerConfig(OptimType.SGD)),
        ManagedCollisionCollection(
            {"odd": MCHManagedCollisionModule(10, None, LFU_EvictionPolicy(), 1)}, configs
        ),
    )
    plan = construct_module_sharding_plan(odd._embedding_module, {"odd": row_wise()}, world_size, world_size)
    env = ShardingEnv.from_process_group(None)
    case.raises_value_error(
        lambda: ManagedCollisionEmbeddingBagCollectionSharder().shard(odd, plan, env), "'odd'", "buckets"
    )
    plan = construct_module_sharding_plan(
        odd._embedding_module, {"odd": table_wise(rank=0)}, world_size, world_size
    )
    plan["odd"].sharding_type = "data_parallel"
    del module
    return True


def test_bad_input_and_configs_fail_on_every_rank():
    assert all(run_world(_bad_input_worker, 3))


def _save_worker(directory: str) -> bool:
    """Train 4 steps at this world size; save the sharded MC-EBC and MC-EC (shardkit.checkpoint) and, on
    rank 0, their unsharded equivalents. Every row-wise table has 12 buckets, so any world size up to 4
    loads them."""
    rank, world_size, _ = case.world()
    for pooled in (True, False):
        reference = build(pooled, world_size, equivalent=True, rw1_buckets=12)
        sharded = shard(build(pooled, world_size, equivalent=False, rw1_buckets=12), world_size)
        assert run_steps(reference, sharded, range(4)) > 0
        checkpoint.save(f"{directory}/sharded_{pooled}", sharded, {"fused": sharded.fused_optimizer})
        if rank == 0:
            fused = reference._embedding_module.fused_optimizer.state_dict()
            torch.save({"model": reference.state_dict(), "fused": fused}, f"{directory}/ref_{pooled}.pt")
    return True


def _load_worker(directory: str) -> bool:
    """Load into differently initialized sharded modules at another world size; continue 4 steps."""
    _, world_size, _ = case.world()
    for pooled in (True, False):
        reference = build(pooled, world_size, equivalent=True, rw1_buckets=12)
        saved = torch.load(f"{directory}/ref_{pooled}.pt", weights_only=False)
        reference.load_state_dict(saved["model"])
        reference._embedding_module.fused_optimizer.load_state_dict(saved["fused"])
        sharded = shard(build(pooled, world_size, equivalent=False, rw1_buckets=12, seed=5), world_size)
        checkpoint.load(f"{directory}/sharded_{pooled}", sharded, {"fused": sharded.fused_optimizer})
        check_state(reference, sharded)
        assert run_steps(reference, sharded, range(4, 8)) > 0
        check_state(reference, sharded)
    # a map cut into other buckets does not load: every rank hears of it
    other = shard(build(True, world_size, equivalent=False, rw1_buckets=24), world_size)
    with pytest.raises(checkpoint.CheckpointError, match="12 buckets, this module 24"):
        checkpoint.load(f"{directory}/sharded_True", other, {"fused": other.fused_optimizer})
    return True


def test_checkpoint_round_trip_at_other_world_sizes(tmp_path):
    assert all(run_world(_save_worker, 2, str(tmp_path)))
    for world_size in (4, 3, 1):
        assert all(run_world(_load_worker, world_size, str(tmp_path)))
