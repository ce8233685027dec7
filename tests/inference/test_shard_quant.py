"""shard_quant_model: a quantized DLRM sharded by the planner answers as the unsharded quantized model.

At world 2 the planner's plan and a plan forced through ``constraints`` (row-wise, column-wise,
table-wise) must give each rank the unsharded quantized model's logits for its own samples, to fp32
reassociation (row-wise partial sums are added by the reduce-scatter).
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.inference import quantize_inference_model, shard_quant_model
from shardkit.models import DLRM
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from shardkit.planner import ParameterConstraints
from shardkit.quant import QuantEmbeddingCollection
from shardkit.sharding.quant_embeddingbag import ShardedQuantEmbeddingBagCollection
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

ROWS = {"t_user": 40, "t_item": 64, "t_ctx": 9}
FEATURES = [(t[2:], rows) for t, rows in ROWS.items()]
TOL = dict(rtol=1e-5, atol=1e-5)


def _quantized() -> DLRM:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(rows, 8, name=t, feature_names=[t[2:]]) for t, rows in ROWS.items()]
    )
    model = DLRM(ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1])
    return quantize_inference_model(model, per_table_weight_dtype={"t_item": torch.quint4x2})


def _dense(step: int, rank: int, batch: int) -> torch.Tensor:
    return torch.randn(batch, 4, generator=torch.Generator().manual_seed(1000 * step + rank))


def _worker(constraints) -> dict:
    rank, world_size, _ = case.world()
    reference = _quantized()
    sharded, plan = shard_quant_model(
        copy.deepcopy(reference), world_size=world_size, constraints=constraints
    )
    ebc = sharded.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, ShardedQuantEmbeddingBagCollection)
    for step in range(2):
        global_kjt, local_kjt, sizes = case.global_and_local(step, rank, world_size, FEATURES, False)
        global_dense = torch.cat([_dense(step, r, sizes[r]) for r in range(world_size)])
        with torch.inference_mode():
            expected = reference(global_dense, global_kjt)
            got = sharded(_dense(step, rank, sizes[rank]), local_kjt)
        torch.testing.assert_close(got, expected[case.my_rows(rank, sizes)], **TOL)
    module_plan = plan.get_plan_for_module("sparse_arch.embedding_bag_collection")
    return {t: module_plan[t].sharding_type for t in ROWS}


def test_planner_plan_at_two_ranks():
    types = run_world(_worker, 2, None)
    assert types[0] == types[1]


def test_constrained_plan_every_quant_sharding_type_at_two_ranks():
    constraints = {
        "t_user": ParameterConstraints(sharding_types=["row_wise"]),
        "t_item": ParameterConstraints(sharding_types=["column_wise"], min_partition=4),
        "t_ctx": ParameterConstraints(sharding_types=["table_wise"], ranks=[1]),
    }
    types = run_world(_worker, 2, constraints)
    assert types[0] == {"t_user": "row_wise", "t_item": "column_wise", "t_ctx": "table_wise"}


def test_world_one_without_a_process_group():
    reference = _quantized()
    sharded, _ = shard_quant_model(copy.deepcopy(reference))
    kjt, _, sizes = case.global_and_local(0, 0, 1, FEATURES, False)
    dense = _dense(0, 0, sizes[0])
    with torch.inference_mode():
        torch.testing.assert_close(sharded(dense, kjt), reference(dense, kjt), **TOL)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size 2, but this process group has 1 rank"):
        shard_quant_model(_quantized(), world_size=2)
    with pytest.raises(ValueError, match="sharding_device 'meta' is not supported"):
        shard_quant_model(_quantized(), sharding_device="meta")
    torch.manual_seed(0)
    ec = EmbeddingCollection([EmbeddingConfig(10, 4, name="t_seq", feature_names=["seq"])])
    model = torch.nn.ModuleDict({"dlrm": _quantized(), "seq": QuantEmbeddingCollection.from_float(ec)})
    with pytest.raises(ValueError, match=r"no sharder for \['seq \(QuantEmbeddingCollection\)'\]"):
        shard_quant_model(model)
