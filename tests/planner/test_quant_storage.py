"""The planner counts a quantized table's stored bytes: packed values plus 4 bytes per row (fp16 scale
and bias), an fp32 output and no optimizer state or gradient.

Table: 100 rows x 10 columns, batch 10 per rank, pooling factor 2, 2 CPU ranks (as test_estimators.py):
a table-wise shard holds 100 rows, and one step outputs 20 bags x 10 values over the world.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.modules import DataType, EmbeddingBagConfig
from shardkit.planner import (
    EmbeddingEnumerator,
    EmbeddingShardingPlanner,
    EmbeddingStorageEstimator,
    ParameterConstraints,
    Topology,
)
from shardkit.quant import QuantEmbeddingBagCollection
from shardkit.sharding.quant_embeddingbag import QuantEmbeddingBagCollectionSharder

BUFFERS = 40 * 8 + 20 * 10 * 4  # the world's ids (int64) and fp32 output values, no gradient


@pytest.mark.parametrize(
    "data_type, table_bytes",
    [
        (DataType.INT8, 100 * (10 + 4)),
        (DataType.INT4, 100 * (5 + 4)),
        (DataType.INT2, 100 * (3 + 4)),  # 10 codes of 2 bits take 3 bytes
        (DataType.FP16, 100 * 10 * 2),
    ],
)
def test_table_wise_storage_counts_quantized_rows(data_type, table_bytes):
    config = EmbeddingBagConfig(100, 10, name="t", feature_names=["f"], data_type=data_type)
    module = QuantEmbeddingBagCollection([config], device=torch.device("meta"))
    topology = Topology(world_size=2, compute_device="cpu")
    enumerator = EmbeddingEnumerator(
        topology, batch_size=10, constraints={"t": ParameterConstraints(pooling_factors=[2.0])}
    )
    ((table, sharder),) = enumerator.tables(module, [QuantEmbeddingBagCollectionSharder()])
    options = {o.sharding_type: o for o in enumerator.enumerate(table, sharder)}
    assert set(options) == {"table_wise", "row_wise"}  # 10 columns are too few to split by columns
    assert {o.compute_kernel for o in options.values()} == {"quant"}
    EmbeddingStorageEstimator().estimate(list(options.values()), topology)
    assert options["table_wise"].ddr.tolist() == pytest.approx([table_bytes + BUFFERS])
    # row-wise: each half of the rows keeps its own scale and bias per row
    assert float(options["row_wise"].ddr.sum()) == pytest.approx(
        table_bytes + 2 * (40 * 8 / 2) + 2 * 20 * 10 * 4
    )


def test_planner_plans_a_quantized_module():
    configs = [
        EmbeddingBagConfig(1000, 16, name=n, feature_names=[n], data_type=DataType.INT4)
        for n in ("a", "b", "c")
    ]
    module = QuantEmbeddingBagCollection(configs, device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu"))
    plan = planner.plan(module, [QuantEmbeddingBagCollectionSharder()])
    shardings = plan.get_plan_for_module("")
    assert sorted(shardings) == ["a", "b", "c"]
    assert {p.compute_kernel for p in shardings.values()} == {"quant"}
