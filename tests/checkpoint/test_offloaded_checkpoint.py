"""Checkpoints of offloaded tables: across kernels, world sizes and plans, exact.

Three launches. At 2 ranks (row-wise, table-wise and column-wise tables, ``fused_uvm_caching`` with a
cache of a few rows, so every step evicts; fused Adagrad) a model trains 3 steps, is saved with
``shardkit.checkpoint`` and raw ``dcp.save``, and trains 3 more (the uninterrupted run). A fresh
in-memory (``fused``) model loads the checkpoint: its tables and Adagrad state *equal* the saved ones,
and its next 3 steps give *equal* tables and state to the uninterrupted run. A fresh ``fused_uvm`` model
loads the raw DCP checkpoint: equal. At 3 ranks under a table-wise plan, an in-memory and an offloaded
model load the 2-rank checkpoint (equal), train 3 steps in lockstep (equal to each other, and close to
the 2-rank uninterrupted run: another world sums gradients in another order), and the offloaded one
saves again; at 1 rank under a third plan, ``fused_uvm`` and ``fused`` models load that (equal).

The state values of offloaded tables are cut into row chunks (``sharding.state_chunks``); the workers
shrink the chunk size to 64 bytes so that every table here is cut into several pieces.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardkit import checkpoint
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.kernels.offload.backing_store import BackingStore
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.sharding import state_chunks
from shardkit.sharding.cache_params import CacheParams
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world
from shardkit.testing.harness import WorldError
from tests.checkpoint.test_checkpoint import _full

TABLES = [("t0", 40), ("t1", 30), ("t2", 24)]
DIM = 4
BATCH = 6  # global samples per step
STEPS = 3


def _plan(world_size: int) -> dict:
    if world_size == 2:
        return {"t0": row_wise(), "t1": table_wise(rank=1), "t2": column_wise(ranks=[0, 1])}
    if world_size == 3:
        return {"t0": table_wise(rank=1), "t1": table_wise(rank=2), "t2": table_wise(rank=0)}
    return {"t0": row_wise(), "t1": column_wise(ranks=[0, 0]), "t2": table_wise(rank=0)}


def sharded(kernel: str, seed: int, offload_dir=None, optimizer: OptimType = OptimType.ADAGRAD):
    """The model at this world size's plan with ``kernel`` for every table (initialized from ``seed``)."""
    torch.manual_seed(seed)
    configs = [EmbeddingBagConfig(rows, DIM, name=n, feature_names=[f"f_{n}"]) for n, rows in TABLES]
    ebc = EmbeddingBagCollection(configs, fused_optimizer=FusedOptimizerConfig(optimizer, lr=0.1))
    plan = construct_module_sharding_plan(ebc, _plan(dist.get_world_size()))
    cache = CacheParams(load_factor=0.05, algorithm="lru", offload_dir=offload_dir)
    plan = {n: dataclasses.replace(p, compute_kernel=kernel, cache_params=cache) for n, p in plan.items()}
    return EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_process_group(None))


def batch(step: int):
    """This rank's samples of global batch ``step`` and the gradient of its pooled output."""
    gen = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, 4, (len(TABLES), BATCH), generator=gen)
    ids = [torch.randint(0, rows, (int(n.sum()),), generator=gen) for (_, rows), n in zip(TABLES, lengths)]
    grad = torch.randn(BATCH, DIM * len(TABLES), generator=gen)
    mine = torch.tensor_split(torch.arange(BATCH), dist.get_world_size())[dist.get_rank()]
    lo, hi = (int(mine[0]), int(mine[-1]) + 1) if mine.numel() else (0, 0)
    values = []
    for table_ids, n in zip(ids, lengths):
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)])
        values.append(table_ids[offsets[lo] : offsets[hi]])
    kjt = KeyedJaggedTensor(
        [f"f_{n}" for n, _ in TABLES], torch.cat(values), lengths=lengths[:, lo:hi].reshape(-1)
    )
    return kjt, grad[lo:hi]


def train(model, steps: range) -> None:
    """Steps of the global batch's loss: a sharded table's gradient is the mean of the ranks' (as
    data-parallel training averages), so each rank's part is scaled by the world size to make the
    update the same at every world size."""
    for step in steps:
        kjt, grad = batch(step)
        (model(kjt).values() * grad).sum().mul(dist.get_world_size()).backward()


def everything(model) -> dict:
    """Every table and Adagrad state, whole, on every rank (a collective)."""
    out = {f"weight.{n}": model.full_table(n) for n, _ in TABLES}
    for table, state in model.fused_optimizer.state_dict()["state"].items():
        out.update({f"{table}.{k}": _full(v) for k, v in state.items()})
    return out


def assert_equal(got: dict, want: dict, where: str) -> None:
    for key, value in want.items():
        if key.endswith(".step") and key not in got:
            continue  # a rank without fused shards does not know the step
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{where}: {key} differs"
        else:
            assert got[key] == value, f"{where}: {key}: {got[key]} != {value}"


def _small_chunks(name: str, *args):
    """Worker: the phase ``name`` with state chunks of 64 bytes (a few rows: every table is cut)."""
    saved = state_chunks.STATE_CHUNK_BYTES
    state_chunks.STATE_CHUNK_BYTES = 64
    try:
        return globals()[name](*args)
    finally:
        state_chunks.STATE_CHUNK_BYTES = saved  # the worker process is reused by other tests


def _optim(model) -> dict:
    return {"fused": model.fused_optimizer}


def _at_two(root: str):
    model = sharded("fused_uvm_caching", 0, root)
    pieces = model.state_dict()["embedding_bags.t0.weight"].local_shards()
    assert len(pieces) > 1, "the offloaded table's state value is cut into row chunks"
    train(model, range(STEPS))
    saved = everything(model)
    checkpoint.save(os.path.join(root, "c2"), model, _optim(model))
    dcp.save(
        {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()},
        checkpoint_id=f"{root}/raw",
    )
    train(model, range(STEPS, 2 * STEPS))
    uninterrupted = everything(model)
    stats = model.cache_stats()
    assert all(s["evictions"] > 0 for s in stats.values()), stats

    in_memory = sharded("fused", 1)
    checkpoint.load(os.path.join(root, "c2"), in_memory, _optim(in_memory))
    assert_equal(everything(in_memory), saved, "offloaded -> fused at 2 ranks")
    # plain load_state_dict between values cut differently (row pieces <-> plan shards), both ways
    copied = sharded("fused_uvm", 3, root)
    copied.load_state_dict(in_memory.state_dict())
    copied.fused_optimizer.load_state_dict(in_memory.fused_optimizer.state_dict())
    assert_equal(everything(copied), saved, "load_state_dict: fused -> fused_uvm")
    back = sharded("fused", 4)
    back.load_state_dict(copied.state_dict())
    back.fused_optimizer.load_state_dict(copied.fused_optimizer.state_dict())
    assert_equal(everything(back), saved, "load_state_dict: fused_uvm -> fused")
    train(in_memory, range(STEPS, 2 * STEPS))
    assert_equal(everything(in_memory), uninterrupted, "continued after the load")

    uvm = sharded("fused_uvm", 2, root)
    state = {"model": uvm.state_dict(), "optim": uvm.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=f"{root}/raw")
    uvm.load_state_dict(state["model"])
    uvm.fused_optimizer.load_state_dict(state["optim"])
    assert_equal(everything(uvm), saved, "raw dcp: offloaded -> fused_uvm")
    return saved, uninterrupted


def _at_three(root: str, saved: dict, uninterrupted: dict) -> bool:
    in_memory, offloaded = sharded("fused", 3), sharded("fused_uvm_caching", 4, root)
    for model in (in_memory, offloaded):
        checkpoint.load(os.path.join(root, "c2"), model, _optim(model))
        assert_equal(everything(model), saved, "2 -> 3 ranks, table-wise")
    checkpoint.save(os.path.join(root, "c3"), offloaded, _optim(offloaded))
    train(in_memory, range(STEPS, 2 * STEPS))
    train(offloaded, range(STEPS, 2 * STEPS))
    got, want = everything(offloaded), everything(in_memory)
    assert_equal(got, want, "offloaded == fused after the load at 3 ranks")
    for key, value in uninterrupted.items():
        if isinstance(value, torch.Tensor) and key in got:
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    return True


def _at_one(root: str, saved: dict) -> bool:
    scratch_files = []
    create = BackingStore.create.__func__

    def counting(cls, fields, identity, directory=None, name="table"):
        scratch_files.extend([name] if name == "scratch" else [])
        return create(cls, fields, identity, directory, name)

    for kernel, seed in (("fused_uvm", 5), ("fused", 6)):
        model = sharded(kernel, seed, root)
        BackingStore.create = classmethod(counting)
        try:
            checkpoint.load(os.path.join(root, "c3"), model, _optim(model))
        finally:
            BackingStore.create = classmethod(create)
        assert_equal(everything(model), saved, f"3 -> 1 rank, {kernel}")
        pieces = sum(len(v.local_shards()) for v in model.state_dict().values())
        if kernel == "fused_uvm":
            # staged in scratch files, one per state value (3 tables, 3 Adagrad sums), not per piece
            assert pieces > 2 * len(TABLES) and len(scratch_files) == 2 * len(TABLES), (pieces, scratch_files)
        else:
            assert not scratch_files, scratch_files  # an in-memory model stages in RAM
        scratch_files.clear()
    return True


def _killed_mid_step(root: str) -> None:
    """Trains, checkpoints after step 2, then rank 1's process dies inside step 4 (between its forward
    and backward): rank 0 fails at the collective timeout."""
    model = sharded("fused_uvm_caching", 0, root)
    train(model, range(STEPS))
    checkpoint.save(os.path.join(root, "last"), model, _optim(model))
    train(model, range(STEPS, STEPS + 1))
    kjt, grad = batch(STEPS + 1)
    out = model(kjt).values()
    if dist.get_rank() == 1:
        os._exit(3)
    (out * grad).sum().mul(dist.get_world_size()).backward()


def _restarted(root: str) -> bool:
    """A fresh job: the model loads the last checkpoint and trains the steps after it; the result
    equals a run that was never interrupted (in memory: offloaded training equals it bitwise)."""
    model = sharded("fused_uvm_caching", 9, root)
    checkpoint.load(os.path.join(root, "last"), model, _optim(model))
    train(model, range(STEPS, 2 * STEPS))
    uninterrupted = sharded("fused", 0)
    train(uninterrupted, range(2 * STEPS))
    assert_equal(everything(model), everything(uninterrupted), "restarted after a rank died mid-step")
    return True


def test_rank_killed_mid_step_then_restart_from_checkpoint_is_exact(tmp_path):
    root = str(tmp_path)
    with pytest.raises(WorldError, match="rank 1 ---\nworker process died"):
        run_world(_killed_mid_step, 2, root, timeout=120, env={"SHARDKIT_TIMEOUT": "10"})
    assert all(run_world(_restarted, 2, root, timeout=300))


def _dmp_round_trip(root: str) -> bool:
    """DistributedModelParallel with offloaded tables (evicting cache) trained through the pipeline,
    saved, loaded into an in-memory DMP: every shard's weights and fused optimizer state equal."""
    from tests.pipeline import test_offloaded_pipeline as offloaded_pipeline
    from tests.pipeline import test_zero_sample_pipeline as base

    rank, world_size = dist.get_rank(), dist.get_world_size()
    reference = base._ebc()
    source = offloaded_pipeline._dmp(reference, "fused_uvm_caching", False, world_size)
    pipeline = offloaded_pipeline._pipeline(source, offloaded_pipeline.TrainPipelineSparseDist)
    data = base._Data(rank, world_size, 6)
    for _ in range(6):
        pipeline.progress(data)
    checkpoint.save(os.path.join(root, "dmp"), source, {"fused": source.fused_optimizer})
    target = offloaded_pipeline._dmp(reference, "fused", False, world_size)
    checkpoint.load(os.path.join(root, "dmp"), target, {"fused": target.fused_optimizer})
    got, want = target.module.ebc, source.module.ebc
    assert want.cache_stats() and all(s["evictions"] > 0 for s in want.cache_stats().values())
    for key, weight in want.local_shards().items():
        assert torch.equal(got.local_shards()[key], weight), key
    loaded = got.fused_optimizer.state_dict()["state"]
    for table, state in want.fused_optimizer.state_dict()["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(_full(loaded[table][name]), _full(value)), (table, name)
            else:
                assert loaded[table][name] == value, (table, name)
    return True


def _rowwise_save(root: str) -> dict:
    model = sharded("fused_uvm_caching", 0, root, OptimType.ROWWISE_ADAGRAD)
    train(model, range(STEPS))
    checkpoint.save(os.path.join(root, "rowwise"), model, _optim(model))
    return everything(model)


def _rowwise_load(root: str, saved: dict) -> bool:
    for kernel, seed in (("fused", 1), ("fused_uvm", 2)):
        model = sharded(kernel, seed, root, OptimType.ROWWISE_ADAGRAD)
        checkpoint.load(os.path.join(root, "rowwise"), model, _optim(model))
        assert_equal(everything(model), saved, f"row-wise Adagrad, offloaded -> {kernel}")
    return True


def test_rowwise_adagrad_state_of_offloaded_tables_moves_with_its_rows(tmp_path):
    """Per-row state ([rows], and [rows, blocks] for the column-wise table), cut into pieces too. Loaded
    at the same plan: a column-split table's per-block state cannot change its number of blocks
    (docs/sharded_state.md), whatever the kernel."""
    saved = run_world(_small_chunks, 2, "_rowwise_save", str(tmp_path), timeout=300)[0]
    assert all(run_world(_small_chunks, 2, "_rowwise_load", str(tmp_path), saved, timeout=300))


def test_offloaded_dmp_checkpoint_loads_into_in_memory_dmp(tmp_path):
    assert all(run_world(_small_chunks, 2, "_dmp_round_trip", str(tmp_path), timeout=300))


def test_offloaded_checkpoints_across_kernels_worlds_and_plans(tmp_path):
    root = str(tmp_path)
    saved, uninterrupted = run_world(_small_chunks, 2, "_at_two", root, timeout=300)[0]
    assert all(run_world(_small_chunks, 3, "_at_three", root, saved, uninterrupted, timeout=300))
    assert all(run_world(_small_chunks, 1, "_at_one", root, saved, timeout=300))
