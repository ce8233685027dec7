"""state_dict_gather / state_dict_to_device at worlds 1-4, every sharding type.

The sharded module holds one table per sharding type (table-wise, row-wise, column-wise, table-row-wise,
table-column-wise, data-parallel; ``tests/sharding/_sharded_case``), next to a dense layer. Gathering its
state dict into a freshly initialized unsharded model (other seed, so nothing passes by accident) must
give rank 0 the reference model's state dict exactly, for ShardedTensor and DTensor values alike.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.inference import state_dict_gather, state_dict_to_device
from shardkit.inference import state_dict_transform as transform
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan
from shardkit.sharding.state_dtensor import StateDTensor
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case


class _Model(nn.Module):
    def __init__(self, tables: nn.Module) -> None:
        super().__init__()
        self.dense = nn.Linear(3, 2)
        self.tables = tables


def _model(seed: int, sequence: bool) -> _Model:
    torch.manual_seed(seed)
    if sequence:  # the sequence collection has no data-parallel table here
        tables = EmbeddingCollection(
            [EmbeddingConfig(r, d, name=n, feature_names=f) for n, r, d, f, _ in case.TABLES if n != "t_dp"]
        )
    else:
        tables = EmbeddingBagCollection(
            [EmbeddingBagConfig(r, d, name=n, feature_names=f, pooling=p) for n, r, d, f, p in case.TABLES]
        )
    return _Model(tables)


def _sharded(reference: _Model, sequence: bool) -> _Model:
    _, world_size, local_size = case.world()
    model = copy.deepcopy(reference)
    plan = construct_module_sharding_plan(
        model.tables, case.plan_generators(world_size, local_size, not sequence), local_size, world_size
    )
    sharder = EmbeddingCollectionSharder() if sequence else EmbeddingBagCollectionSharder()
    model.tables = sharder.shard(model.tables, plan, ShardingEnv.from_process_group(None))
    return model


def _gather_worker(sequence: bool) -> list:
    rank, world_size, _ = case.world()
    reference = _model(0, sequence)
    sharded = _sharded(reference, sequence)
    src = sharded.state_dict()
    kinds = sorted({type(v).__name__ for v in src.values()})
    fresh = _model(1, sequence).state_dict()  # other values everywhere
    expected = reference.state_dict()
    assert any(not torch.equal(fresh[k], expected[k]) for k in expected)
    state_dict_gather(src, fresh)
    if rank == 0:
        assert list(fresh) == list(expected)
        for key in expected:
            assert torch.equal(fresh[key], expected[key]), key

    # moved to a device (here the same one): still sharded the same way, and gathers the same
    moved = state_dict_to_device(src, None, torch.device("cpu"))
    for key, value in src.items():
        assert type(moved[key]) is type(value), key
        if isinstance(value, (ShardedTensor, StateDTensor)):
            a = [(s.metadata.shard_offsets, s.tensor) for s in value.local_shards()]
            b = [(s.metadata.shard_offsets, s.tensor) for s in moved[key].local_shards()]
            assert [o for o, _ in a] == [o for o, _ in b]
            assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))
    again = _model(2, sequence).state_dict()
    state_dict_gather(moved, again)
    if rank == 0:
        assert all(torch.equal(again[k], expected[k]) for k in expected)
    return kinds


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gather_every_sharding_type(world_size):
    local = 2 if world_size == 4 else None  # two hosts of two: table-row/column-wise over hosts
    kinds = run_world(_gather_worker, world_size, False, local_world_size=local)
    # both kinds of sharded value are exercised (DTensor: replicated and even splits)
    assert {"ShardedTensor", "StateDTensor"} <= set(kinds[0]), kinds[0]


def test_gather_sequence_tables_at_three_ranks():
    run_world(_gather_worker, 3, True)


def _disagreement_worker() -> str:
    rank, _, _ = case.world()
    reference = _model(0, False)
    src = _sharded(reference, False).state_dict()
    dst = _model(1, False).state_dict()
    if rank == 1:
        del dst["dense.bias"]
    with pytest.raises(ValueError, match="ranks pass dst with different keys"):
        state_dict_gather(src, dst)
    dst = _model(1, False).state_dict()
    if rank == 1:
        del src["tables.embedding_bags.t_rw.weight"]
    missing = r"rank 1: 'tables.embedding_bags.t_rw.weight' is in dst but not in src"
    with pytest.raises(ValueError, match=missing):
        state_dict_gather(src, dst)
    dst["dense.weight"] = torch.zeros(5, 5)
    with pytest.raises(ValueError, match=r"'dense.weight': src has shape \[2, 3\], dst \[5, 5\]"):
        state_dict_gather(_sharded(reference, False).state_dict(), dst)
    with pytest.raises(ValueError, match="ranks pass different keys"):
        state_dict_to_device(src, None, torch.device("cpu"))
    return "ok"


def test_disagreeing_ranks_fail_on_every_rank():
    assert run_world(_disagreement_worker, 2) == ["ok", "ok"]


def _plain_dtensor_worker() -> list:
    """Plain DTensors (not shardkit's), uneven, split by rows and by columns, and replicated; rank 0
    receives them one rank's piece at a time (each receive at most one piece, never a whole table)."""
    rank, world_size, _ = case.world()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    full = torch.arange(35.0).reshape(7, 5)
    src = {
        "rows": distribute_tensor(full, mesh, [Shard(0)]),
        "cols": distribute_tensor(full, mesh, [Shard(1)]),
        "replicated": distribute_tensor(full, mesh, [Replicate()]),
    }
    dst = {key: torch.zeros(7, 5, dtype=torch.float64) for key in src}
    received = []
    real_recv = dist.recv

    def recording_recv(tensor, src=None, **kwargs):
        received.append(tensor.numel())
        return real_recv(tensor, src=src, **kwargs)

    with mock.patch.object(transform.dist, "recv", recording_recv):
        state_dict_gather(src, dst)
    if rank == 0:
        assert all(torch.equal(dst[key], full.double()) for key in dst)
        biggest_piece = max(-(-7 // world_size) * 5, 7 * -(-5 // world_size))
        assert received and max(received) <= biggest_piece < full.numel()
    return received


def test_plain_dtensors_gathered_piece_by_piece_at_three_ranks():
    received = run_world(_plain_dtensor_worker, 3)
    # rows: ranks 1, 2 send [3, 5] and [1, 5]; columns: [7, 2] and [7, 1]; replicated: nothing
    assert received[0] == [15, 5, 14, 7] and received[1] == received[2] == []
