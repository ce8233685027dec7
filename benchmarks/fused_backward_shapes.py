"""The fused backward + SGD (or row-wise Adagrad) kernel alone, at the shapes of ``vs_torchrec_sweep`` rows:
shardkit's native kernel against fbgemm's CPU TBE (what torchrec runs), when fbgemm imports.

Run from the repository root: ``python -m benchmarks.fused_backward_shapes`` (with fbgemm:
``PYTHONPATH=src:. $HOME/peers/torchrec/bin/python -m benchmarks.fused_backward_shapes``); ~1 min.

Each shape is one rank's kernel call in a sweep row, built here from the sweep's own rules (table sizes
geometric from 1e3, bag lengths uniform in [1, 2 * pooling - 1], uniform ids; row-wise: the ids in this
rank's block of rows): ``row32`` (row-wise, batch 2048 x 2 ranks, 8 tables of up to 1e6 rows, half of each
table's rows here, dim 16), ``row35`` (data-parallel, 8 tables of up to 3e5 rows, this rank's 2048 samples;
an approximation: the fused replica's kernel runs on a scratch buffer of the gathered rows, here on the
whole tables), ``row27`` (row-wise, batch 256 x 2, 256 tables of up to 2.8e4 rows, dim 64), and for
``--optimizer rowwise_adagrad`` (both libraries apply row-wise Adagrad, EXACT_ROWWISE_ADAGRAD) also the
sweep's row-wise Adagrad rows ``row31`` / ``row34`` / ``row29`` / ``row23`` (see SHAPES). One thread. The
gradient is batch-major (a KeyedTensor's layout), as the sharded lookup hands it over. Between two timed
calls a 64 MiB buffer is written, so that the table and the gradient do not stay in cache from one call to
the next (in a training step other work evicts them). Reported: median ms per call of shardkit's backward +
SGD (``sk_bwd_ms``), of fbgemm's forward + backward + SGD minus its forward (``fbgemm_bwd_ms``; its backward
runs inside autograd), and their ratio (> 1: shardkit faster). Absolute times on a shared machine are noise;
the ratio is measured in the same run, calls alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List, Optional

import torch

from benchmarks.common import write_results
from shardkit.kernels import RowOptimizerArgs, embedding_forward, embedding_fused_backward

# name: (tables, top rows, dim, bags per feature, pooling, rows kept per table (1: all, 2: half))
SHAPES = {
    "row32": (8, 1_000_000, 16, 4096, 20, 2),
    "row35": (8, 302_000, 16, 2048, 20, 1),
    "row27": (256, 28_300, 64, 512, 2, 2),
    # the row-wise Adagrad rows (rw_adagrad): row31 table-wise (this rank's 4 of 8 tables, here all 8),
    # row34 table-row-wise (half of each table's rows), row29 (256 tables, dim 16), row23 (column-wise:
    # 64 tables cut in two 32-wide blocks, each rank 64 blocks)
    "row31": (8, 631_589, 128, 2048, 20, 1),
    "row34": (8, 631_589, 128, 4096, 20, 2),
    "row29": (256, 167_825, 16, 512, 2, 2),
    "row23": (64, 163_997, 32, 256, 4, 1),
}
LR = 0.01
EPS = 1e-8


def _inputs(tables: int, top: int, dim: int, batch: int, pooling: int, part: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    full = [round(1_000 * (top / 1_000) ** (t / max(1, tables - 1))) for t in range(tables)]
    sizes = [rows // part for rows in full]  # this rank's block: the first rows of each table
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]])
    lengths = torch.randint(1, 2 * pooling, (tables * batch,), generator=gen)
    limit = torch.tensor(full, dtype=torch.float64).repeat_interleave(batch).repeat_interleave(lengths)
    ids = (torch.rand(limit.numel(), generator=gen, dtype=torch.float64) * limit).long()
    # the ids this rank receives: those in its block (row-wise bucketize)
    bags = torch.arange(tables * batch).repeat_interleave(lengths)
    mine = ids < torch.tensor(sizes).repeat_interleave(batch)[bags]
    ids = ids[mine]
    lengths = torch.bincount(bags[mine], minlength=tables * batch)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    shift = starts.repeat_interleave(batch)
    weight = torch.empty(sum(sizes), dim).uniform_(-0.01, 0.01, generator=gen)
    grad = torch.randn(batch, tables * dim, generator=gen)
    return weight, ids, offsets, shift, grad, sizes


def _fbgemm(sizes: List[int], dim: int, optimizer: str):
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError:
        return None
    specs = [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in sizes]
    kind = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[optimizer]
    return SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=kind, learning_rate=LR, eps=EPS)


def _optimizer(optimizer: str, rows: int) -> RowOptimizerArgs:
    if optimizer == "sgd":
        return RowOptimizerArgs("SGD", lr=LR)
    return RowOptimizerArgs("ROWWISE_ADAGRAD", lr=LR, eps=EPS, state=(torch.zeros(rows),))


def measure(name: str, repeats: int, optimizer: str = "sgd") -> Dict[str, Any]:
    tables, top, dim, batch, pooling, part = SHAPES[name]
    weight, ids, offsets, shift, grad, sizes = _inputs(tables, top, dim, batch, pooling, part)
    rule = _optimizer(optimizer, weight.size(0))
    tbe = _fbgemm(sizes, dim, optimizer)
    # fbgemm: feature-major [tables * batch] bags of table-local ids, output [batch, tables * dim]
    flush = torch.zeros(16 * 2**20)
    times: Dict[str, List[float]] = {"sk": [], "fb_fwd": [], "fb_all": []}

    def timed(key: str, fn) -> None:
        flush.add_(1.0)
        start = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - start)

    def shardkit_bwd() -> None:
        embedding_fused_backward(weight, ids, offsets, shift, None, None, grad, True, rule, batch_major=batch)

    def fb_fwd() -> None:
        with torch.no_grad():
            tbe(ids, offsets)

    def fb_all() -> None:
        tbe(ids, offsets).backward(grad)

    embedding_forward(weight, ids, offsets, shift, batch_major=batch)  # builds / loads the native kernels
    for r in range(repeats + 1):
        order = [("sk", shardkit_bwd)] + ([("fb_fwd", fb_fwd), ("fb_all", fb_all)] if tbe else [])
        for key, fn in order if r % 2 == 0 else order[::-1]:
            if r == 0:
                fn()  # warm-up
            else:
                timed(key, fn)
    row: Dict[str, Any] = {"name": name, "optimizer": optimizer, "ids": ids.numel(), "rows": weight.size(0)}
    row["dim"] = dim
    row["sk_bwd_ms"] = 1e3 * statistics.median(times["sk"])
    if tbe is not None:
        fb = statistics.median(times["fb_all"]) - statistics.median(times["fb_fwd"])
        row["fbgemm_bwd_ms"] = 1e3 * fb
        row["ratio"] = 1e3 * fb / row["sk_bwd_ms"]
    return row


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per library and shape")
    parser.add_argument(
        "--optimizer",
        choices=["sgd", "rowwise_adagrad"],
        default="sgd",
        help="the fused rule (both libraries)",
    )
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    parsed = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(name, parsed.repeats, parsed.optimizer) for name in parsed.shapes]
    meta = {"repeats": parsed.repeats, "threads": 1, "optimizer": parsed.optimizer}
    write_results("fused_backward_shapes", meta, rows, parsed.out)


if __name__ == "__main__":
    main()
