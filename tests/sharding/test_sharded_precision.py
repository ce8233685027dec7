"""Reduced precision in a sharded EmbeddingBagCollection, table-wise and row-wise, at 2 ranks.

- Quantized comm codecs (fp16 forward, bf16 backward) on the pooled all-to-all and reduce-scatter:
  outputs within fp16 rounding of the fp32 run (rtol = atol = 2e-3; fp16 keeps 11 significant bits),
  tables after fused SGD steps within bf16 rounding of the gradient step (atol 1e-3: lr 0.1 times a
  gradient of size ~1 rounded to 8 bits, over 3 steps).
- fp16 and bf16 tables: outputs and tables after steps equal the unsharded module of the same dtype
  on the global batch, to that dtype's rounding (row-wise sums partial sums in another order):
  fp16 rtol = atol = 2e-3, bf16 rtol = atol = 2e-2.
"""

from __future__ import annotations

import copy

import torch

from shardkit.distributed.codecs import CommType, QCommsConfig, get_qcomm_codecs
from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimizerConfig,
    OptimType,
)
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from shardkit.sharding.types import CommOp
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

# one table-wise and one row-wise table of each width; uneven rows
TABLES = [("t_tw", 11, 4, ["f_tw"]), ("t_rw", 13, 4, ["f_rw"]), ("t_rw2", 9, 6, ["f_rw2"])]
FEATURES = [(f, rows) for _, rows, _, feats in TABLES for f in feats]
CODEC_TOL = dict(rtol=2e-3, atol=2e-3)
CODEC_WEIGHT_TOL = dict(rtol=0.0, atol=1e-3)
TABLE_TOL = {DataType.FP16: dict(rtol=2e-3, atol=2e-3), DataType.BF16: dict(rtol=2e-2, atol=2e-2)}


def _module(data_type: DataType) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(rows, dim, name=name, feature_names=feats, data_type=data_type)
        for name, rows, dim, feats in TABLES
    ]
    return EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=case.LR))


def _shard(module: EmbeddingBagCollection, registry=None):
    _, world_size, local_size = case.world()
    generators = {"t_tw": table_wise(rank=1), "t_rw": row_wise(), "t_rw2": row_wise()}
    plan = construct_module_sharding_plan(module, generators, local_size, world_size)
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    return sharder.shard(copy.deepcopy(module), plan, ShardingEnv.from_process_group(None))


def _steps(sharded, reference=None):
    """This rank's outputs (as fp32) over ``case.STEPS`` training steps of ``sharded``, and those of
    ``reference`` stepping on the global batch (the same loss, as in the exactness tests)."""
    rank, world_size, _ = case.world()
    width = sum(dim for _, _, dim, _ in TABLES)
    outs, expected_outs = [], []
    for step in range(case.STEPS):
        global_kjt, local_kjt, batch = case.global_and_local(step, rank, world_size, FEATURES, False)
        mine = case.my_rows(rank, batch)
        grad = torch.randn(sum(batch), width, generator=torch.Generator().manual_seed(step))
        out = sharded(local_kjt).values()
        (out.float() * grad[mine]).sum().backward()
        outs.append(out.detach().float())
        if reference is not None:
            expected = reference(global_kjt).values()
            (expected.float() * grad).sum().div(world_size).backward()
            expected_outs.append(expected[mine].detach().float())
    return outs, expected_outs


def _codecs_worker() -> bool:
    codecs = get_qcomm_codecs(QCommsConfig(CommType.FP16, CommType.BF16))
    registry = {
        CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value: codecs,
        CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value: codecs,
    }
    module = _module(DataType.FP32)
    exact, quantized = _shard(module), _shard(module, registry)
    exact_outs, _ = _steps(exact)
    quantized_outs, _ = _steps(quantized)
    for a, b in zip(quantized_outs, exact_outs):
        assert not torch.equal(a, b) or a.numel() == 0  # the codecs did round
        torch.testing.assert_close(a, b, **CODEC_TOL)
    for key, weight in quantized.local_shards().items():
        torch.testing.assert_close(weight, exact.local_shards()[key], **CODEC_WEIGHT_TOL)
    return True


def _tables_worker() -> bool:
    for data_type in (DataType.FP16, DataType.BF16):
        reference = _module(data_type)
        sharded = _shard(reference)
        assert all(w.dtype == reference.table_weight("t_tw").dtype for w in sharded.local_shards().values())
        outs, expected = _steps(sharded, reference)
        for a, b in zip(outs, expected):
            torch.testing.assert_close(a, b, **TABLE_TOL[data_type])
        for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
            torch.testing.assert_close(
                weight.float(),
                reference.table_weight(name)[r0:r1, c0:c1].detach().float(),
                **TABLE_TOL[data_type],
            )
    return True


def test_fp16_forward_bf16_backward_codecs_match_fp32():
    assert all(run_world(_codecs_worker, 2))


def test_fp16_and_bf16_tables_match_unsharded():
    assert all(run_world(_tables_worker, 2))
