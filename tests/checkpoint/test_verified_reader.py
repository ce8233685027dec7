"""Raw ``dcp.load`` with ``VerifiedFileSystemReader`` on several ranks: a checkpoint saved by
``shardkit.checkpoint.save`` at 2 ranks loads exactly at 3 ranks under another plan; a data file
damaged on disk is an error on every rank before any rank writes into its tables."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardkit import checkpoint
from shardkit.checkpoint import VerifiedFileSystemReader
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from shardkit.testing import run_world

TABLES = {"a": 11, "b": 6}


def _sharded(seed: int):
    torch.manual_seed(seed)
    configs = [EmbeddingBagConfig(rows, 4, name=n, feature_names=[n]) for n, rows in TABLES.items()]
    ebc = EmbeddingBagCollection(configs, fused_optimizer=FusedOptimizerConfig("ADAGRAD", lr=0.1))
    if dist.get_world_size() == 2:
        plan_of = {"a": row_wise(), "b": column_wise(ranks=[0, 1])}
    else:
        plan_of = {"a": table_wise(rank=2), "b": row_wise()}
    plan = construct_module_sharding_plan(ebc, plan_of)
    return EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_process_group(None))


def _tables(model) -> dict:
    return {name: model.full_table(name) for name in TABLES}


def _save(root: str) -> dict:
    model = _sharded(0)
    checkpoint.save(os.path.join(root, "ckpt"), model, {"fused": model.fused_optimizer})
    return _tables(model)


def _raw_load(root: str, expected: dict) -> bool:
    model = _sharded(1)
    before = _tables(model)
    state = {"model": model.state_dict(), "optim": {"fused": model.fused_optimizer.state_dict()}}
    damaged = os.path.join(root, "damaged")
    with pytest.raises(CheckpointException, match=r"__1_0\.distcp: checksum mismatch"):
        dcp.load(state, storage_reader=VerifiedFileSystemReader(damaged))
    for name, table in _tables(model).items():  # refused before any rank wrote
        assert torch.equal(table, before[name]), f"table {name} was written by a refused load"
    dcp.load(state, storage_reader=VerifiedFileSystemReader(os.path.join(root, "ckpt")))
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"]["fused"])
    for name, table in _tables(model).items():
        assert torch.equal(table, expected[name]), f"table {name} differs after the raw load"
    return True


def test_raw_dcp_load_with_the_verified_reader_reshards_and_refuses_damage(tmp_path):
    expected = run_world(_save, 2, str(tmp_path))[0]
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "ckpt", damaged)
    data = damaged / "__1_0.distcp"  # written by rank 1 of the save
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    assert all(run_world(_raw_load, 3, str(tmp_path), expected))
