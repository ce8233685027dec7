"""DLRM runs its sparse arch's collection before its dense arch (the output all-to-all overlaps the
dense arch, forward and backward): the losses, gradients and trained weights are bitwise those of
torchrec's dense-first order, unsharded and sharded under TrainPipelineSparseDist on 2 ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardkit.datasets import Batch
from shardkit.models import DLRM, DLRMTrain
from shardkit.models.dlrm import SparseArch
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world

KEYS = ["f0", "f1", "f2", "f3"]
ROWS = [10, 20, 30, 40]


class _DenseFirst(SparseArch):
    """A subclass overriding forward: DLRM then runs torchrec's order (dense arch first)."""

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return super().forward(features)


def _tables():
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=rows, feature_names=[key])
        for i, (key, rows) in enumerate(zip(KEYS, ROWS))
    ]


def _dlrm(dense_first: bool, device=None) -> DLRMTrain:
    torch.manual_seed(0)
    dlrm = DLRM(EmbeddingBagCollection(_tables(), device=device), 3, [8, 4], [8, 1])
    if dense_first:
        dlrm.sparse_arch.__class__ = _DenseFirst
    return DLRMTrain(dlrm)


def _batch(step: int, rank: int = 0, batch: int = 4) -> Batch:
    gen = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (len(KEYS) * batch,), generator=gen)
    bounds = torch.tensor(ROWS).repeat_interleave(batch).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=gen) * bounds).long()
    kjt = KeyedJaggedTensor(KEYS, values, lengths=lengths)
    return Batch(torch.rand(batch, 3, generator=gen), kjt, torch.randint(0, 2, (batch,), generator=gen))


def _train_unsharded(dense_first: bool):
    model = _dlrm(dense_first)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        optimizer.zero_grad()
        loss, _ = model(_batch(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_unsharded_order_is_bitwise_torchrec_s():
    new, old = _train_unsharded(False), _train_unsharded(True)
    assert all(torch.equal(a, b) for a, b in zip(new[0], old[0]))
    assert new[1].keys() == old[1].keys()
    assert all(torch.equal(new[1][k], old[1][k]) for k in new[1])


def _train_sharded(dense_first: bool):
    from shardkit.distributed import DistributedModelParallel
    from shardkit.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from shardkit.distributed.train_pipeline import TrainPipelineSparseDist
    from shardkit.distributed.types import ShardingPlan
    from shardkit.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from shardkit.optim.optimizers import in_backward_optimizer_filter

    rank = dist.get_rank()
    model = _dlrm(dense_first, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": "SGD", "learning_rate": 0.1})
    path = "model.sparse_arch.embedding_bag_collection"
    plan = construct_module_sharding_plan(
        model.get_submodule(path),
        {f"t{i}": table_wise(rank=i % 2) for i in range(len(KEYS))},
        sharder=sharder,
        local_size=2,
        world_size=2,
        device_type="cpu",
    )
    torch.manual_seed(1)
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({path: plan}), sharders=[sharder]
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    pipeline = TrainPipelineSparseDist(
        dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), torch.device("cpu")
    )
    assert pipeline.pipelined_modules == [path]  # the traced model still hands the collection its input
    batches = iter([_batch(step, rank) for step in range(4)])
    losses = [pipeline.progress(batches)[0] for _ in range(4)]
    state = {k: _local(v) for k, v in dmp.state_dict().items()}
    return losses, state


def _local(value) -> torch.Tensor:
    """A state-dict entry's values on this rank: a sharded table's local shards, flattened."""
    if hasattr(value, "local_shards"):
        shards = [shard.tensor.detach().reshape(-1) for shard in value.local_shards()]
        return torch.cat(shards) if shards else torch.zeros(0)
    return value.detach().clone()


def _sharded_worker():
    new, old = _train_sharded(False), _train_sharded(True)
    assert all(torch.equal(a, b) for a, b in zip(new[0], old[0])), (new[0], old[0])
    assert new[1].keys() == old[1].keys() and new[1]
    differ = [k for k in new[1] if not torch.equal(new[1][k], old[1][k])]
    assert not differ, differ
    return len(new[1])


def test_sharded_pipelined_order_is_bitwise_torchrec_s():
    assert all(run_world(_sharded_worker, 2, timeout=300))
