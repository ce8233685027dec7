"""200 pipelined training steps at world 3 with random batch sizes (0 included) and a variable batch
per feature equal the unsharded collection trained on the global batches (issue 23).

The model is an EmbeddingBagCollection under DistributedModelParallel with tables table-wise (on two
ranks), row-wise, column-wise and data-parallel; the loss is a fixed per-sample weighting of the
pooled values, so a rank with zero samples adds nothing and the reference is the global batch's sum
divided by the world size (what the output dists' gradient division and DDP's averaging train).
TrainPipelineSparseDist runs the steps (PrefetchTrainPipelineSparseDist fewer); every step's output
and the shards at the end are compared.
"""

from __future__ import annotations

import copy
import random
from typing import Iterator, List, Tuple

import pytest
import torch
from torch import nn

from shardkit.datasets import Batch
from shardkit.model_parallel import CombinedOptimizer, DistributedModelParallel
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.pipeline import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist
from shardkit.sharding.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from shardkit.sharding.types import ShardingPlan
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world
from tests.sharding import _sharded_case as case

STEPS = 200
LR = 0.05
TOL = dict(rtol=1e-4, atol=1e-5)
# (table, rows, dim, features)
TABLES = [
    ("tw0", 11, 4, ["a"]),
    ("tw2", 7, 3, ["b", "c"]),
    ("rw", 13, 4, ["d"]),
    ("cw", 9, 6, ["e"]),
    ("dp", 5, 2, ["f"]),
]
FEATURES = [(f, rows) for _, rows, _, feats in TABLES for f in feats]
WIDTH = sum(dim * len(feats) for _, _, dim, feats in TABLES)


def _sizes(step: int, world_size: int) -> List[int]:
    """Each rank's batch size at ``step``: 0 to 3, zero on about one rank in three."""
    rng = random.Random(step)
    return [rng.choice([0, 0, 1, 2, 3, 3]) for _ in range(world_size)]


def _loss_weights(step: int, rank: int, samples: int) -> torch.Tensor:
    return torch.randn(samples, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank))


def _batches(step: int, rank: int, world_size: int) -> Tuple[Batch, KeyedJaggedTensor, torch.Tensor, slice]:
    """(this rank's batch, the global KJT, the global loss weights, this rank's rows of the global)."""
    sizes = _sizes(step, world_size)
    global_kjt, local_kjt, _ = case.variable_batch(step, rank, world_size, FEATURES, sizes)
    weights = [_loss_weights(step, r, sizes[r]) for r in range(world_size)]
    labels = torch.zeros(sizes[rank])
    return Batch(weights[rank], local_kjt, labels), global_kjt, torch.cat(weights), case.my_rows(rank, sizes)


class _Model(nn.Module):
    """forward(batch) -> (sum of the pooled values weighted by ``batch.dense_features``, the values)."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        values = self.ebc(batch.sparse_features).values()
        return (values * batch.dense_features).sum(), values.detach()


class _Data:
    def __init__(self, rank: int, world_size: int, steps: int) -> None:
        self._rank, self._world_size, self._step, self._steps = rank, world_size, 0, steps

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._step == self._steps:
            raise StopIteration
        batch = _batches(self._step, self._rank, self._world_size)[0]
        self._step += 1
        return batch


def _ebc() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(rows, dim, name=n, feature_names=f) for n, rows, dim, f in TABLES]
    return EmbeddingBagCollection(configs, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=LR))


def _worker(prefetch: bool, steps: int) -> int:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    reference = _ebc()
    generators = {
        "tw0": table_wise(rank=0),
        "tw2": table_wise(rank=world_size - 1),
        "rw": row_wise(),
        "cw": column_wise(ranks=[0, world_size - 1]),
        "dp": data_parallel(),
    }
    plan = ShardingPlan(
        {"ebc": construct_module_sharding_plan(reference, generators, world_size, world_size)}
    )
    dmp = DistributedModelParallel(_Model(copy.deepcopy(reference)), plan=plan)
    dense = torch.optim.SGD(dict(dmp.bare_named_parameters()).values(), lr=LR)
    optimizer = CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])
    pipeline_type = PrefetchTrainPipelineSparseDist if prefetch else TrainPipelineSparseDist
    pipeline = pipeline_type(dmp, optimizer, torch.device("cpu"))
    data = _Data(rank, world_size, steps)
    empty_steps = 0
    for step in range(steps):
        out = pipeline.progress(data)
        batch, global_kjt, weights, mine = _batches(step, rank, world_size)
        expected = reference(global_kjt).values()
        (expected * weights).sum().div(world_size).backward()
        assert out.shape == (mine.stop - mine.start, WIDTH), (step, tuple(out.shape))
        torch.testing.assert_close(
            out, expected[mine].detach(), **TOL, msg=lambda m, s=step: f"step {s}: {m}"
        )
        empty_steps += int(mine.stop == mine.start)
    with pytest.raises(StopIteration):  # every batch trained once, none past the data
        pipeline.progress(data)
    shards = dmp.module.ebc.local_shards()
    assert {"rw", "dp"} <= {name for name, *_ in shards}  # dp: the replica, stepped by DDP + SGD
    for (name, r0, r1, c0, c1), weight in shards.items():
        torch.testing.assert_close(weight, reference.table_weight(name)[r0:r1, c0:c1].detach(), **TOL)
    return empty_steps


@pytest.mark.parametrize("prefetch, steps", [(False, STEPS), (True, 60)])
def test_pipelined_random_batch_sizes_with_zero_samples_at_world_3(prefetch, steps):
    empty_steps = run_world(_worker, 3, prefetch, steps, timeout=300)
    # every rank had zero samples at some steps, and all three at once at some step
    assert all(n >= steps // 10 for n in empty_steps), empty_steps
    assert any(_sizes(step, 3) == [0, 0, 0] for step in range(steps))
