"""The whole recommender stack on one device at world 1: every sharding type, DMP + the train pipelines,
managed collision and quantized serving, each against the unsharded module on the CPU.

Each case runs on ``cpu`` (gloo) in the normal suite and on ``cuda`` (NCCL) where a GPU exists
(marked ``cuda``: ``tools/device_check.sh`` runs them on a GPU machine), so the same assertions hold
the device paths (Triton kernels, device placement of shards, buffers and optimizer state) to the
CPU reference.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import List

import pytest
import torch

from shardkit.distributed.sharding_env import ShardingEnv
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimizerConfig,
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
    OptimType,
    PoolingType,
)
from shardkit.sharding.cache_params import CacheParams
from shardkit.sharding.embedding import EmbeddingCollectionSharder
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sharding.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from shardkit.sparse import KeyedJaggedTensor
from tests.sharding import _sharded_case as case

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS = 3

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def _device(device_type: str) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


# one table per sharding type trained by the fused optimizer; (table, rows, dim, features, sharding).
# Not here: data-parallel tables (dense parameters, trained by the dense optimizer: the DMP case has
# them) and row-wise Adagrad (one accumulator per column block, docs/sharding.md, so a column-sharded
# table differs from the unsharded one by design).
POOLED = [
    ("t_tw", 50, 8, ["f_tw"], table_wise(rank=0)),
    ("t_rw", 40, 8, ["f_rw1", "f_rw2"], row_wise()),
    ("t_cw", 30, 16, ["f_cw"], column_wise(ranks=[0, 0])),
    ("t_twrw", 33, 4, ["f_twrw"], table_row_wise(host_index=0)),
    ("t_twcw", 21, 8, ["f_twcw"], table_column_wise(host_index=0, num_shards=2)),
]
SEQUENCE = POOLED[:3]  # EC: TW, RW, CW


def _features(tables) -> List[tuple]:
    return [(f, rows) for _, rows, _, feats, _ in tables for f in feats]


def _every_sharding_type(device_type: str, pooled: bool, optimizer_name: str, kernel: str = "fused") -> bool:
    """Forward, backward and fused optimizer steps of a sharded EBC / EC on ``device_type`` against
    the unsharded module on the CPU, one table per sharding type; weights compared at the end.
    ``kernel``: the compute kernel of every table (the offloading ones with a cache of 10% of the rows;
    their tables live in host memory, so their weights are on the CPU)."""
    device = _device(device_type)
    optimizer = FusedOptimizerConfig(OptimType[optimizer_name], lr=0.1)
    tables = POOLED if pooled else SEQUENCE
    torch.manual_seed(0)
    if pooled:
        configs = [
            EmbeddingBagConfig(
                rows, dim, name=n, feature_names=f, pooling=PoolingType.MEAN if "rw" in n else PoolingType.SUM
            )
            for n, rows, dim, f, _ in tables
        ]
        reference = EmbeddingBagCollection(configs, fused_optimizer=optimizer)
        sharder = EmbeddingBagCollectionSharder()
    else:
        configs = [EmbeddingConfig(rows, dim, name=n, feature_names=f) for n, rows, dim, f, _ in tables]
        reference = EmbeddingCollection(configs, fused_optimizer=optimizer)
        sharder = EmbeddingCollectionSharder()
    generators = {n: generator for n, _, _, _, generator in tables}
    plan = construct_module_sharding_plan(reference, generators, 1, 1, device_type=device_type)
    if kernel != "fused":
        cache = CacheParams(load_factor=0.1, algorithm="lfu", prefetch_pipeline=False)
        plan = {
            n: dataclasses.replace(ps, compute_kernel=kernel, cache_params=cache) for n, ps in plan.items()
        }
    sharded = sharder.shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None), device=device
    )
    for step in range(STEPS):
        kjt = case.to_kjt(case.batch_rows(step, 5, _features(tables)))
        expected = reference(kjt)
        out = sharded(kjt.to(device))
        if pooled:
            expected_values, values = [expected.values()], [out.values()]
            assert out.keys() == expected.keys()
        else:
            assert list(out.keys()) == list(expected.keys())
            expected_values = [expected[k].values() for k in expected.keys()]
            values = [out[k].values() for k in expected.keys()]
        for mine, want in zip(values, expected_values):
            assert mine.device.type == device_type
            torch.testing.assert_close(mine.detach().cpu(), want.detach(), **TOL)
        grads = [torch.randn(v.shape, generator=torch.Generator().manual_seed(step)) for v in expected_values]
        sum((v * g).sum() for v, g in zip(expected_values, grads)).backward()
        sum((v * g.to(device)).sum() for v, g in zip(values, grads)).backward()
    for (name, r0, r1, c0, c1), weight in sharded.local_shards().items():
        assert weight.device.type == (device_type if kernel == "fused" else "cpu"), name
        want = reference.table_weight(name)[r0:r1, c0:c1].detach()
        torch.testing.assert_close(weight.detach().cpu(), want, **TOL, msg=name)
    return True


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("pooled", [True, False], ids=["ebc", "ec"])
@pytest.mark.parametrize("optimizer_name", ["SGD", "ADAGRAD", "ADAM"])
def test_every_sharding_type(run_world, device_type, pooled, optimizer_name):
    result = run_world(
        _every_sharding_type, 1, device_type, pooled, optimizer_name, backend=_backend(device_type)
    )
    assert result == [True]


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("pooled", [True, False], ids=["ebc", "ec"])
@pytest.mark.parametrize("kernel", ["fused_uvm_caching", "fused_uvm"])
def test_offloaded_tables(run_world, device_type, pooled, kernel):
    result = run_world(
        _every_sharding_type, 1, device_type, pooled, "ADAGRAD", kernel, backend=_backend(device_type)
    )
    assert result == [True]


def _dmp_and_pipelines(device_type: str) -> bool:
    """The DLRM of tests/model_parallel under DistributedModelParallel on ``device_type``, trained by
    the plain loop, TrainPipelineSparseDist and PrefetchTrainPipelineSparseDist: each equals the
    unsharded model trained on the CPU on the same batches."""
    from shardkit.model_parallel import CombinedOptimizer, DistributedModelParallel
    from shardkit.pipeline import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist
    from shardkit.sharding.types import ShardingPlan
    from tests.model_parallel import _dlrm as d

    device = _device(device_type)
    steps = 4
    reference = d.make_model()
    reference_losses = d.train_reference(copy.deepcopy(reference), steps, 1)
    trained_reference = copy.deepcopy(reference)
    d.train_reference(trained_reference, steps, 1)
    kinds = [table_wise(rank=0), row_wise(), column_wise(ranks=[0]), data_parallel()]
    generators = {name: kinds[i % len(kinds)] for i, (name, *_) in enumerate(d.TABLES)}

    def build():
        plan = ShardingPlan(
            {"ebc": construct_module_sharding_plan(reference.ebc, generators, 1, 1, device_type=device_type)}
        )
        # as with torchrec, the model is built on (or moved to) the device; DMP materializes only meta
        # parameters there
        dmp = DistributedModelParallel(copy.deepcopy(reference).to(device), device=device, plan=plan)
        dense = torch.optim.SGD(dict(dmp.bare_named_parameters()).values(), lr=d.LR)
        return dmp, CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])

    batches = [d.rank_batch(step, 0) for step in range(steps)]
    dmp, optimizer = build()
    losses, logits = [], []
    for batch in batches:
        optimizer.zero_grad()
        loss, out = dmp(batch.to(device))
        assert loss.device.type == device_type
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        logits.append(out.cpu())
    torch.testing.assert_close(losses, reference_losses, **TOL)
    d.assert_same_weights(_on_cpu(dmp.module), trained_reference, TOL)
    for pipeline_type in (TrainPipelineSparseDist, PrefetchTrainPipelineSparseDist):
        dmp, optimizer = build()
        pipeline = pipeline_type(dmp, optimizer, device)
        data = iter(batches)
        # progress returns the model's output (the logits), as torchrec's pipelines do
        piped = [pipeline.progress(data).cpu() for _ in range(steps)]
        with pytest.raises(StopIteration):
            pipeline.progress(data)
        for mine, want in zip(piped, logits):
            torch.testing.assert_close(mine, want, **TOL, msg=pipeline_type.__name__)
        d.assert_same_weights(_on_cpu(dmp.module), trained_reference, TOL)
    return True


class _on_cpu(torch.nn.Module):
    """A view of a trained sharded DLRM with its dense parameters and table shards copied to the CPU."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self._model = model
        self.ebc = _CpuShards(model.ebc)

    def named_parameters(self, *args, **kwargs):
        for name, param in self._model.named_parameters(*args, **kwargs):
            yield name, param.detach().cpu()


class _CpuShards:
    def __init__(self, ebc) -> None:
        self._ebc = ebc

    def local_shards(self):
        return {key: weight.detach().cpu() for key, weight in self._ebc.local_shards().items()}


@pytest.mark.parametrize("device_type", DEVICES)
def test_dmp_and_train_pipelines(run_world, device_type):
    assert run_world(_dmp_and_pipelines, 1, device_type, backend=_backend(device_type)) == [True]


def _managed_collision(device_type: str) -> bool:
    """A sharded MC-EBC (row-wise and table-wise tables, LFU evictions every step) on ``device_type``
    against the unsharded MC-EBC on the CPU: outputs, remapped ids and tables."""
    device = _device(device_type)

    def build():
        torch.manual_seed(0)
        configs = [
            EmbeddingBagConfig(16, 4, name="rw", feature_names=["u"]),
            EmbeddingBagConfig(8, 4, name="tw", feature_names=["w"]),
        ]
        modules = {
            c.name: MCHManagedCollisionModule(
                c.num_embeddings, None, LFU_EvictionPolicy(), 1, 10**6, name=c.name
            )
            for c in configs
        }
        return ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(configs, fused_optimizer=FusedOptimizerConfig(OptimType.ADAGRAD, lr=0.1)),
            ManagedCollisionCollection(modules, configs),
            return_remapped_features=True,
        )

    reference = build()
    module = build()
    plan = construct_module_sharding_plan(
        module, {"rw": row_wise(), "tw": table_wise(rank=0)}, 1, 1, device_type=device_type
    )
    sharded = ManagedCollisionEmbeddingBagCollectionSharder().shard(
        module, plan, ShardingEnv.from_process_group(None), device=device
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        lengths = torch.randint(0, 4, (2 * 6,), generator=gen)
        values = torch.randint(0, 10**6, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor(["u", "w"], values, lengths=lengths)
        expected, expected_ids = reference(kjt)
        out, ids = sharded(kjt.to(device))
        assert out.values().device.type == device_type
        torch.testing.assert_close(out.values().detach().cpu(), expected.values().detach(), **TOL)
        torch.testing.assert_close(ids.values().cpu(), expected_ids.values())
        grad = torch.randn(expected.values().shape, generator=gen)
        (expected.values() * grad).sum().backward()
        (out.values() * grad.to(device)).sum().backward()
    for (name, r0, r1, c0, c1), weight in sharded._embedding_module.local_shards().items():
        want = reference._embedding_module.table_weight(name)[r0:r1, c0:c1].detach()
        torch.testing.assert_close(weight.detach().cpu(), want, **TOL, msg=name)
    return True


@pytest.mark.parametrize("device_type", DEVICES)
def test_managed_collision(run_world, device_type):
    assert run_world(_managed_collision, 1, device_type, backend=_backend(device_type)) == [True]


def _quantized_serving(device_type: str) -> bool:
    """A quantized EBC (int8, int4, fp16 tables) sharded table-, row- and column-wise on
    ``device_type`` equals the unsharded quantized module on the CPU."""
    from shardkit.modules import DataType
    from shardkit.quant import QuantEmbeddingBagCollection
    from shardkit.sharding.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
    from shardkit.sharding.types import EmbeddingComputeKernel

    device = _device(device_type)
    quant = EmbeddingComputeKernel.QUANT.value
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(20, 8, name="i8", feature_names=["a"], data_type=DataType.INT8),
        EmbeddingBagConfig(17, 6, name="i4", feature_names=["b"], data_type=DataType.INT4),
        EmbeddingBagConfig(9, 10, name="f16", feature_names=["c"], data_type=DataType.FP16),
    ]
    reference = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(configs))
    generators = {
        "i8": table_wise(rank=0, compute_kernel=quant),
        "i4": row_wise(compute_kernel=quant),
        "f16": column_wise(ranks=[0, 0], compute_kernel=quant),
    }
    plan = construct_module_sharding_plan(reference, generators, 1, 1, device_type=device_type)
    sharded = QuantEmbeddingBagCollectionSharder().shard(
        copy.deepcopy(reference), plan, ShardingEnv.from_process_group(None), device=device
    )
    for step in range(3):
        kjt = case.to_kjt(case.batch_rows(step, 2, [("a", 20), ("b", 17), ("c", 9)]))
        expected = reference(kjt)
        out = sharded(kjt.to(device))
        assert out.values().device.type == device_type
        torch.testing.assert_close(out.values().cpu(), expected.values(), **TOL)
    return True


@pytest.mark.parametrize("device_type", DEVICES)
def test_quantized_serving(run_world, device_type):
    assert run_world(_quantized_serving, 1, device_type, backend=_backend(device_type)) == [True]
