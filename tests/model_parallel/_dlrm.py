"""A small DLRM-style model, its batches, and the unsharded reference run (shared with tests/pipeline).

Every rank builds every rank's batch from fixed seeds, so the reference can train the unsharded model
on the global batch (all ranks' samples, in rank order) anywhere. Ranks hold equal batches, so the
mean loss of the global batch equals the mean of the ranks' mean losses: the quantity DDP and the
sharded modules' output dists (which divide gradients by the world size) train.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from shardkit.datasets import Batch, concat_batches
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.sparse import KeyedJaggedTensor

LR = 0.1
BATCH = 4  # samples per rank
DENSE_IN = 5
DIM = 4  # width of the dense arch output and of the interacting tables

# (table, rows, dim, features): mixed sizes; the 4-wide tables interact, the 6-wide go straight on
TABLES: List[Tuple[str, int, int, List[str]]] = [
    ("t0", 40, 4, ["f0"]),
    ("t1", 7, 4, ["f1", "f1b"]),
    ("t2", 23, 6, ["f2"]),
    ("t3", 100, 4, ["f3"]),
    ("t4", 5, 6, ["f4"]),
    ("t5", 64, 4, ["f5"]),
    ("t6", 13, 4, ["f6"]),
    ("t7", 31, 6, ["f7"]),
    ("t8", 9, 4, ["f8"]),
    ("t9", 50, 4, ["f9"]),
]
FEATURES = [(f, rows) for _, rows, _, feats in TABLES for f in feats]


class DLRM(nn.Module):
    """Dense MLP + EmbeddingBagCollection + pairwise dot interaction + over-arch MLP.

    forward(batch) -> (mean BCE loss, logits ``[B]`` detached).
    """

    def __init__(self, device: torch.device = None, optimizer: OptimType = OptimType.SGD) -> None:
        super().__init__()
        self.dense_arch = nn.Sequential(
            nn.Linear(DENSE_IN, 8, device=device), nn.ReLU(), nn.Linear(8, DIM, device=device)
        )
        tables = [EmbeddingBagConfig(rows, dim, name=n, feature_names=f) for n, rows, dim, f in TABLES]
        self.ebc = EmbeddingBagCollection(
            tables, device=device, fused_optimizer=FusedOptimizerConfig(optimizer, lr=LR)
        )
        dims = {f: dim for _, _, dim, feats in TABLES for f in feats}
        self._dims = [dims[f] for f in self.ebc.feature_names()]
        self._interacting = [i for i, d in enumerate(self._dims) if d == DIM]
        self._wide = [i for i, d in enumerate(self._dims) if d != DIM]
        n = len(self._interacting) + 1
        pairs = n * (n - 1) // 2
        wide = sum(self._dims[i] for i in self._wide)
        self.over_arch = nn.Sequential(
            nn.Linear(DIM + pairs + wide, 8, device=device), nn.ReLU(), nn.Linear(8, 1, device=device)
        )
        rows, cols = torch.triu_indices(n, n, offset=1)
        self._pair_rows, self._pair_cols = rows.tolist(), cols.tolist()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        dense = self.dense_arch(batch.dense_features)
        pooled = self.ebc(batch.sparse_features).values().split(self._dims, dim=1)
        stacked = torch.stack([dense, *[pooled[i] for i in self._interacting]], dim=1)  # [B, n, DIM]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self._pair_rows, self._pair_cols]
        wide = [pooled[i] for i in self._wide]
        logits = self.over_arch(torch.cat([dense, dots, *wide], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def rank_batch(step: int, rank: int) -> Batch:
    """Rank ``rank``'s batch at ``step`` (fixed seeds; some bags empty)."""
    gen = torch.Generator().manual_seed(1000003 * step + 7919 * rank + 11)
    lengths, values = [], []
    for _, rows in FEATURES:
        for n in torch.randint(0, 4, (BATCH,), generator=gen).tolist():
            lengths.append(n)
            values.extend(torch.randint(0, rows, (n,), generator=gen).tolist())
    kjt = KeyedJaggedTensor(
        [f for f, _ in FEATURES],
        torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
    )
    dense = torch.randn(BATCH, DENSE_IN, generator=gen)
    labels = torch.randint(0, 2, (BATCH,), generator=gen).float()
    return Batch(dense, kjt, labels)


def global_batch(step: int, world_size: int) -> Batch:
    """All ranks' samples of ``step``, in rank order, as one batch."""
    return concat_batches([rank_batch(step, r) for r in range(world_size)])


def make_model(seed: int = 0, optimizer: OptimType = OptimType.SGD) -> DLRM:
    torch.manual_seed(seed)
    return DLRM(optimizer=optimizer)


def train_reference(model: DLRM, steps: int, world_size: int) -> List[float]:
    """Train the unsharded ``model`` in place on the global batches; the losses, step by step."""
    dense = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("ebc.")], lr=LR)
    losses = []
    for step in range(steps):
        dense.zero_grad()
        loss, _ = model(global_batch(step, world_size))
        loss.backward()
        dense.step()
        losses.append(loss.item())
    return losses


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def assert_same_weights(sharded_model: nn.Module, reference: DLRM, tol: Dict[str, float]) -> None:
    """Dense parameters by name, and every local table shard against the reference table's block."""
    ref = dict(reference.named_parameters())
    for name, param in sharded_model.named_parameters():
        if not name.startswith("ebc."):
            torch.testing.assert_close(param.detach(), ref[name].detach(), **tol, msg=name)
    for (table, r0, r1, c0, c1), weight in sharded_model.ebc.local_shards().items():
        expected = reference.ebc.table_weight(table)[r0:r1, c0:c1]
        torch.testing.assert_close(weight.detach(), expected.detach(), **tol, msg=table)


def row_wise_dmp(data_parallel_wrapper: nn.Module) -> nn.Module:
    """A fresh copy of ``make_model()`` with every table row-wise over the default group, under
    DistributedModelParallel with ``data_parallel_wrapper`` (its dense part in DDP)."""
    from shardkit.model_parallel import DistributedModelParallel
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise
    from shardkit.sharding.types import ShardingPlan

    world = dist.get_world_size()
    model = copy.deepcopy(make_model())
    by_table = {name: row_wise() for name, *_ in TABLES}
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, by_table, world, world)})
    return DistributedModelParallel(model, plan=plan, data_parallel_wrapper=data_parallel_wrapper)


def train_dense_sgd(dmp: nn.Module, steps: int, dense_step: bool = True) -> Dict[str, torch.Tensor]:
    """``steps`` steps of ``dmp`` on this rank's batches, its dense parameters under SGD (no SGD step
    when ``dense_step`` is False: the gradients alone); returns the dense parameters themselves (name ->
    parameter; the caller clones what it keeps), whose ``.grad`` holds the last step's gradient."""
    dense = torch.optim.SGD(dict(dmp.bare_named_parameters()).values(), lr=LR)
    for step in range(steps):
        dense.zero_grad()
        loss, _ = dmp(rank_batch(step, dist.get_rank()))
        loss.backward()
        if dense_step:
            dense.step()
    return {n: p for n, p in dmp.module.named_parameters() if not n.startswith("ebc.")}
