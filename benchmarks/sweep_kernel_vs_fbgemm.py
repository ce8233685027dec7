"""The lookup kernels alone at a row of the vs_torchrec sweep: shardkit's native ops against fbgemm's TBE.

``PYTHONPATH=src:. $HOME/peers/torchrec/bin/python -m benchmarks.sweep_kernel_vs_fbgemm --rows 17 31``
(needs fbgemm, the torchrec venv of ``../shared/peers/setup.sh``). For each sweep row
(``benchmarks.vs_torchrec_sweep.grid``): all of the row's tables on one thread, rank 0's first batch of
that row (``batch`` samples, feature-major bags), the row's optimizer, lr 0.01. shardkit: one table
buffer (advised huge pages, as a grouped lookup's), ``embedding_forward`` then
``embedding_fused_backward`` with a fixed ``[batch, tables * dim]`` gradient; fbgemm: a
``SplitTableBatchedEmbeddingBagsCodegen`` forward, then its backward with the same gradient. Per round the
two libraries run in a random order, each after a 64 MiB write that evicts the last-level cache; main
thread CPU time (``time.thread_time``, less sensitive than wall time to other load). Prints the medians
and the median per-round ratio shardkit / fbgemm of forward, backward and their sum (< 1: shardkit
takes less time). The sweep's row is a 2-rank step; this is the kernels' share of it, not the step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings
from typing import Dict, List, Optional

import torch

from benchmarks.common import write_results
from benchmarks.vs_torchrec import _batches
from benchmarks.vs_torchrec_sweep import grid, label
from shardkit import huge_pages
from shardkit.kernels import RowOptimizerArgs, embedding_forward, embedding_fused_backward, kernel_backend

RULES = {"sgd": "SGD", "adagrad": "ADAGRAD", "rowwise_adagrad": "ROWWISE_ADAGRAD"}


def _tbe(rows: List[int], dim: int, optimizer: str):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    kind = {
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }[optimizer]
    specs = [(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows]
    return SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=kind, learning_rate=0.01)


def _rank_lookup(config: Dict, rank: int, world: int = 2) -> tuple:
    """``(table rows, values, lengths, batch)`` of the lookup rank ``rank`` of a ``world``-rank
    table-wise plan runs: its tables (``t % world == rank``, the sweep's placement) and every rank's
    first batch, each feature's bags in source-rank order (as the KJT all-to-all delivers them)."""
    tables, batch = config["tables"], config["batch"]
    per_rank = []
    for source in range(world):
        values, lengths = _batches(config, source)[0]
        per_feature = lengths.view(tables, batch)
        per_rank.append((values.split(per_feature.sum(1).tolist()), per_feature))
    mine = [t for t in range(tables) if t % world == rank]
    values = torch.cat([per_rank[s][0][t] for t in mine for s in range(world)])
    lengths = torch.cat([per_rank[s][1][t] for t in mine for s in range(world)])
    return [config["table_rows"][t] for t in mine], values, lengths, world * batch


def measure_row(number: int, rounds: int, rank: Optional[int] = None) -> Dict[str, float]:
    """Median ms and median per-round ratios for sweep row ``number`` (1-based); ``rank``: only the
    lookup that rank of the 2-rank table-wise plan runs (see :func:`_rank_lookup`)."""
    config = grid()[number - 1]
    rows, dim, batch = config["table_rows"], config["dim"], config["batch"]
    values, lengths = _batches(config, 0)[0]
    if rank is not None:
        rows, values, lengths, batch = _rank_lookup(config, rank)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    weight = huge_pages.empty(sum(rows), dim).uniform_(-0.01, 0.01)
    rule = RULES[config["optimizer"]]
    state = {
        "SGD": (),
        "ADAGRAD": (huge_pages.empty(sum(rows), dim).zero_(),),
        "ROWWISE_ADAGRAD": (huge_pages.empty(sum(rows)).zero_(),),
    }[rule]
    shift = torch.tensor([0] + rows[:-1]).cumsum(0).repeat_interleave(batch)
    grad = torch.randn(batch, len(rows) * dim, generator=torch.Generator().manual_seed(0)) * 1e-3
    tbe = _tbe(rows, dim, config["optimizer"])
    evict = torch.empty(64 << 18)

    def shardkit() -> tuple:
        args = RowOptimizerArgs(rule, lr=0.01, eps=1e-8, state=state)
        with kernel_backend("native"):
            t0 = time.thread_time()
            embedding_forward(weight, values, offsets, shift, None, None, True, batch)
            t1 = time.thread_time()
            embedding_fused_backward(
                weight, values, offsets, shift, None, None, grad, True, args, False, batch
            )
        return t1 - t0, time.thread_time() - t1

    def fbgemm() -> tuple:
        t0 = time.thread_time()
        out = tbe(values, offsets)
        t1 = time.thread_time()
        out.backward(grad)
        return t1 - t0, time.thread_time() - t1

    libs = {"shardkit": shardkit, "fbgemm": fbgemm}
    times: Dict[str, List[tuple]] = {lib: [] for lib in libs}
    order = random.Random(number)
    for r in range(rounds + 2):  # two warm-up rounds
        names = list(libs)
        order.shuffle(names)
        for lib in names:
            evict.add_(1.0)
            took = libs[lib]()
            if r >= 2:
                times[lib].append(took)
    result: Dict[str, float] = {"name": label(config), "row": number, "ids": values.numel()}
    if rank is not None:
        result["rank"] = rank
    for i, part in enumerate(("fwd", "bwd")):
        for lib in libs:
            result[f"{lib}_{part}_ms"] = 1e3 * statistics.median(t[i] for t in times[lib])
        result[f"{part}_ratio"] = statistics.median(a[i] / b[i] for a, b in zip(*times.values()))
    result["sum_ratio"] = statistics.median(sum(a) / sum(b) for a, b in zip(*times.values()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[17, 31], help="sweep rows (1-based)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--rank",
        type=int,
        choices=(0, 1),
        help="only the lookup this rank of a 2-rank table-wise plan runs (its tables, both ranks' batches)",
    )
    parser.add_argument("--out", default=None, help="directory for sweep_kernel_vs_fbgemm.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results = [measure_row(n, args.rounds, args.rank) for n in args.rows]
    config = {"rounds": args.rounds, "threads": 1, "rank": args.rank}
    write_results("sweep_kernel_vs_fbgemm", config, results, args.out)


if __name__ == "__main__":
    main()
