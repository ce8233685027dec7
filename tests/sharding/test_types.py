"""Plan types, sharding specs and the ShardedModule / ModuleSharder interfaces."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.distributed.awaitable import LazyAwaitable, LazyNoWait, NoWait
from shardkit.sharding import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ModuleSharder,
    NullShardedModuleContext,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
    get_tensor_size_bytes,
)


def _row_wise(sizes, cols=4, ranks=None):
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    ranks = list(range(len(sizes))) if ranks is None else ranks
    shards = [ShardMetadata([o, 0], [s, cols], f"rank:{r}/cpu") for o, s, r in zip(offsets, sizes, ranks)]
    return EnumerableShardingSpec(shards)


def test_enum_values_follow_the_specification():
    assert [t.value for t in ShardingType] == [
        "data_parallel",
        "table_wise",
        "column_wise",
        "row_wise",
        "table_row_wise",
        "table_column_wise",
        "grid_shard",
    ]
    assert EmbeddingComputeKernel("fused") is EmbeddingComputeKernel.FUSED


def test_parameter_sharding_accepts_enums_and_rejects_unknown_names():
    ps = ParameterSharding(ShardingType.ROW_WISE, EmbeddingComputeKernel.FUSED, [0, 1], _row_wise([3, 2]))
    assert (ps.sharding_type, ps.compute_kernel) == ("row_wise", "fused")
    ps.check("t", [5, 4], world_size=2)
    with pytest.raises(ValueError, match="unknown sharding_type 'row_wize'"):
        ParameterSharding("row_wize", "fused")
    with pytest.raises(ValueError, match="unknown compute_kernel 'fast'"):
        ParameterSharding("table_wise", "fast")


@pytest.mark.parametrize(
    "sharding, match",
    [
        (
            ParameterSharding("table_wise", "dense", [3], _row_wise([5], ranks=[3])),
            r"ranks \[3\] are outside",
        ),
        (ParameterSharding("table_wise", "dense", [0, 1], _row_wise([3, 2])), "names one rank"),
        (ParameterSharding("row_wise", "dense", [0, 1]), "needs a sharding_spec"),
        (ParameterSharding("row_wise", "dense", [0, 1], _row_wise([3, 1])), "cover 16 of the 20"),
        (ParameterSharding("row_wise", "dense", None, _row_wise([3, 3])), "does not fit"),
        (ParameterSharding("row_wise", "dense", [1, 0], _row_wise([3, 2])), "disagree with the shards"),
        (
            ParameterSharding(
                "column_wise",
                "dense",
                None,
                EnumerableShardingSpec(
                    [ShardMetadata([0, 0], [5, 3], "rank:0/cpu"), ShardMetadata([0, 2], [5, 2], "rank:1/cpu")]
                ),
            ),
            "overlap",
        ),
    ],
)
def test_parameter_sharding_check_names_the_table(sharding, match):
    with pytest.raises(ValueError, match=match) as info:
        sharding.check("table_7", [5, 4], world_size=2)
    assert "table_7" in str(info.value)


def test_data_parallel_needs_no_spec_and_shard_metadata_parses_placement():
    ParameterSharding("data_parallel", "dense").check("t", [5, 4], world_size=3)
    shard = ShardMetadata([0, 0], [1, 1], "rank:12/cuda:3")
    assert (shard.rank, shard.device) == (12, "cuda:3")
    assert ShardMetadata([0], [1], "rank:2").device == "cpu"
    with pytest.raises(ValueError, match="not of the form"):
        ShardMetadata([0], [1], "cuda:0")
    with pytest.raises(ValueError, match="different lengths"):
        ShardMetadata([0, 0], [1], "rank:0/cpu")


def test_sharding_plan_lookup_and_printing():
    module_plan = EmbeddingModuleShardingPlan({"t1": ParameterSharding("table_wise", "fused", [1])})
    plan = ShardingPlan({"sparse.ebc": module_plan})
    assert plan.get_plan_for_module("sparse.ebc") is module_plan
    assert plan.get_plan_for_module("dense") is None
    assert module_plan["t1"].ranks == [1]
    text = str(plan)
    assert "sparse.ebc" in text and "table_wise" in text and "fused" in text


class _Scale(ShardedModule[torch.Tensor, torch.Tensor, torch.Tensor, NullShardedModuleContext]):
    """A toy sharded module: input dist and output dist are no-ops, compute scales by a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(3.0))
        self.calls = []

    def create_context(self):
        self.calls.append("create_context")
        return NullShardedModuleContext()

    def input_dist(self, ctx, x):
        self.calls.append("input_dist")
        return NoWait(NoWait(x))

    def compute(self, ctx, dist_input):
        self.calls.append("compute")
        return dist_input * self.scale

    def output_dist(self, ctx, output):
        self.calls.append("output_dist")
        return LazyNoWait(output)


def test_sharded_module_forward_chains_the_steps_and_returns_a_lazy_awaitable():
    module = _Scale()
    out = module(torch.ones(2))
    assert isinstance(out, LazyAwaitable)
    assert module.calls == ["create_context", "input_dist", "compute", "output_dist"]
    assert torch.equal(torch.add(out, 1), torch.full((2,), 4.0))  # used like the tensor
    out.wait().sum().backward()
    assert module.scale.grad == 2.0
    assert list(module.sharded_parameter_names("m")) == ["m.scale"]
    assert module.qcomm_codecs_registry is None


class _ScaleSharder(ModuleSharder[nn.Linear]):
    @property
    def module_type(self):
        return nn.Linear

    def shard(self, module, params, env, device=None):
        return _Scale()


def test_module_sharder_defaults():
    sharder = _ScaleSharder()
    linear = nn.Linear(3, 2)
    assert list(sharder.shardable_parameters(linear)) == ["weight", "bias"]
    assert sharder.sharding_types("cpu") == ["data_parallel"]
    assert sharder.compute_kernels("data_parallel", "cpu") == ["default"]
    assert sharder.storage_usage(linear.weight, "cpu", "default") == {"ddr": 24}
    assert sharder.storage_usage(linear.weight, "cuda", "default") == {"hbm": 24}
    with pytest.raises(ValueError, match="unknown compute_device_type 'tpu'"):
        sharder.storage_usage(linear.weight, "tpu", "default")
    assert isinstance(
        sharder.shard(linear, EmbeddingModuleShardingPlan(), ShardingEnv.from_local(1, 0)), _Scale
    )
    assert get_tensor_size_bytes(torch.empty(5, 4, dtype=torch.float16, device="meta")) == 40
