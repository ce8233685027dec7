"""Train pipelines: step throughput of the plain training loop vs TrainPipelineSparseDist (and prefetch).

Run from the repository root: ``python -m benchmarks.pipeline [--ranks 2 --steps 30]``.

A DLRM-style model (dense MLP, an EmbeddingBagCollection of ``--tables`` tables of ``--rows`` rows
and dim ``--dim`` with fused SGD, dot interaction, over-arch MLP) under DistributedModelParallel on
``--ranks`` CPU ranks (gloo), tables alternately table-wise and row-wise, ``--batch`` samples per rank
and ``--pooling`` ids per bag. Each variant trains ``--steps`` steps over the same batches (after
``--warmup`` steps), ``--repeats`` times; a step's time is the slowest rank's.

- ``steps/s``: median throughput;
- ``vs plain``: throughput over the plain loop's in the same run (> 1: the pipeline is faster).

On a CPU machine with few cores the ranks' communication and compute compete for the same cores, so
the overlap the pipeline creates has little room to pay off; the ratio shows what is left after its
bookkeeping.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import write_results
from shardkit.distributed.validation import set_validation
from shardkit.model_parallel import CombinedOptimizer, DistributedModelParallel
from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
from shardkit.pipeline import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist
from shardkit.sharding.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from shardkit.sharding.types import ShardingPlan
from shardkit.sparse import KeyedJaggedTensor
from shardkit.testing import run_world


class Batch:
    def __init__(self, dense: torch.Tensor, sparse: KeyedJaggedTensor, labels: torch.Tensor) -> None:
        self.dense, self.sparse, self.labels = dense, sparse, labels

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )


class DLRM(nn.Module):
    def __init__(self, tables: int, rows: int, dim: int) -> None:
        super().__init__()
        configs = [
            EmbeddingBagConfig(rows, dim, name=f"t{i}", feature_names=[f"f{i}"]) for i in range(tables)
        ]
        self.ebc = EmbeddingBagCollection(
            configs, fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=0.01)
        )
        self.dense_arch = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, dim))
        n = tables + 1
        rows_idx, cols_idx = torch.triu_indices(n, n, offset=1)
        self._pairs = (rows_idx.tolist(), cols_idx.tolist())
        self.over_arch = nn.Sequential(nn.Linear(dim + len(self._pairs[0]), 64), nn.ReLU(), nn.Linear(64, 1))
        self._tables, self._dim = tables, dim

    def forward(self, batch: Batch):
        dense = self.dense_arch(batch.dense)
        sparse = self.ebc(batch.sparse).values().view(-1, self._tables, self._dim)
        stacked = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        logits = self.over_arch(torch.cat([dense, dots], dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def make_batches(count: int, rank: int, cfg: Dict[str, int]) -> List[Batch]:
    gen = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(count):
        lengths = torch.randint(1, 2 * cfg["pooling"], (cfg["tables"] * cfg["batch"],), generator=gen)
        values = torch.randint(0, cfg["rows"], (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor([f"f{i}" for i in range(cfg["tables"])], values, lengths=lengths)
        dense = torch.randn(cfg["batch"], 16, generator=gen)
        labels = torch.randint(0, 2, (cfg["batch"],), generator=gen).float()
        batches.append(Batch(dense, kjt, labels))
    return batches


def _build(cfg: Dict[str, int]):
    torch.manual_seed(0)
    model = DLRM(cfg["tables"], cfg["rows"], cfg["dim"])
    world = dist.get_world_size()
    generators = {
        f"t{i}": (table_wise(rank=i % world) if i % 2 == 0 else row_wise()) for i in range(cfg["tables"])
    }
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, generators, world, world)})
    dmp = DistributedModelParallel(model, plan=plan)
    dense = torch.optim.SGD(dict(dmp.bare_named_parameters()).values(), lr=0.01)
    return dmp, CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])


def _plain(dmp, optimizer):
    def run(batches: List[Batch]) -> None:
        for batch in batches:
            optimizer.zero_grad()
            loss, _ = dmp(batch)
            loss.backward()
            optimizer.step()

    return run, None


def _pipelined(pipeline_type):
    def make(dmp, optimizer):
        # built (and the model traced) outside the timed region; one pass over ``batches`` per run
        pipeline = pipeline_type(dmp, optimizer, torch.device("cpu"))

        def run(batches: List[Batch]) -> None:
            data = iter(batches)
            try:
                while True:
                    pipeline.progress(data)
            except StopIteration:
                pass

        return run, pipeline

    return make


VARIANTS = {
    "plain loop": _plain,
    "TrainPipelineSparseDist": _pipelined(TrainPipelineSparseDist),
    "PrefetchTrainPipelineSparseDist": _pipelined(PrefetchTrainPipelineSparseDist),
}


def _worker(cfg: Dict[str, int]) -> Dict[str, List[float]]:
    """Per variant, the seconds of each repeat of ``steps`` steps (max over ranks)."""
    set_validation(False)  # input checks are a per-step host sync and all-gather: not what is measured
    rank = dist.get_rank()
    warmup, batches = make_batches(cfg["warmup"], rank, cfg), make_batches(cfg["steps"], rank, cfg)
    dmp, optimizer = _build(cfg)
    times: Dict[str, List[float]] = {name: [] for name in VARIANTS}
    for _ in range(cfg["repeats"]):
        for name, make in VARIANTS.items():  # interleaved so that machine noise hits every variant
            run, pipeline = make(dmp, optimizer)
            run(warmup)
            dist.barrier()
            start = time.perf_counter()
            run(batches)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
            if pipeline is not None:
                pipeline.detach()
    return times


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=512, help="samples per rank")
    parser.add_argument("--pooling", type=int, default=10, help="mean ids per bag")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    cfg = {
        k: getattr(args, k)
        for k in ("tables", "rows", "dim", "batch", "pooling", "steps", "warmup", "repeats")
    }
    times = run_world(_worker, args.ranks, cfg, timeout=1800)[0]
    rows: List[Dict[str, Any]] = []
    plain = None
    for name, seconds in times.items():
        median = sorted(seconds)[len(seconds) // 2]
        throughput = cfg["steps"] / median
        plain = plain or throughput
        rows.append({"name": name, "steps/s": throughput, "vs plain": throughput / plain})
    write_results("pipeline", {**cfg, "ranks": args.ranks, "backend": "gloo"}, rows, args.out)


if __name__ == "__main__":
    main()
