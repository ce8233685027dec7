"""Quantized tables: bytes per table and pooled-lookup time per storage, against fp32 in the same run.

Run from the repository root: ``python -m benchmarks.quant_lookup [--rows 1000000 --dim 64]``.

One table of ``--rows`` x ``--dim`` random values, stored as fp32 (the float module's grouped lookup,
``shardkit.kernels.embedding_forward``) and as each storage of ``shardkit.kernels.quant_rows`` (fp16,
bf16, int8, int4, int2), looked up by ``quant_embedding_forward`` (native C++ when built, and the
pure-torch path) with the same random ids: ``--batch`` bags of ``--pooling`` ids, SUM pooling, fp32 out.
Columns: ``table_MiB`` (the stored bytes), ``bytes_vs_fp32`` (their ratio to the fp32 table), ``ms``
(median pooled-lookup time) and ``time_vs_fp32`` (its ratio to the fp32 lookup on the same backend
family: native vs the native fp32 kernel, torch vs the torch fp32 path), ``max_abs_err`` (of the pooled
output against the fp32 table's).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List

import torch

from benchmarks.common import median_seconds, write_results
from shardkit.kernels import embedding_forward, kernel_backend, native_ops
from shardkit.kernels.quant_embedding import quant_embedding_forward
from shardkit.kernels.quant_rows import STORAGES, quantize_rows

MIB = float(1 << 20)


def rows_for(args: argparse.Namespace) -> List[Dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(args.rows, args.dim, generator=gen) * 0.05
    ids = torch.randint(0, args.rows, (args.batch * args.pooling,), generator=gen)
    offsets = torch.arange(0, args.batch * args.pooling + 1, args.pooling)
    backends = ["native", "torch"] if native_ops() is not None else ["torch"]
    out: List[Dict[str, Any]] = []
    fp32_bytes = table.numel() * 4
    for backend in backends:
        with kernel_backend(backend):
            reference = embedding_forward(table, ids, offsets)
            base = median_seconds(lambda: embedding_forward(table, ids, offsets), args.repeats)
            out.append(
                dict(
                    name=f"fp32 table, grouped lookup ({backend})",
                    storage="fp32 (float module)",
                    backend=backend,
                    table_MiB=fp32_bytes / MIB,
                    bytes_vs_fp32=1.0,
                    ms=base * 1e3,
                    time_vs_fp32=1.0,
                    max_abs_err=0.0,
                )
            )
            for storage in STORAGES:
                stored = quantize_rows(table, storage)
                pooled = quant_embedding_forward(stored, storage, args.dim, ids, offsets)
                seconds = median_seconds(
                    lambda s=stored, st=storage: quant_embedding_forward(s, st, args.dim, ids, offsets),
                    args.repeats,
                )
                out.append(
                    dict(
                        name=f"{storage} stored rows ({backend})",
                        storage=storage,
                        backend=backend,
                        table_MiB=stored.numel() / MIB,
                        bytes_vs_fp32=stored.numel() / fp32_bytes,
                        ms=seconds * 1e3,
                        time_vs_fp32=seconds / base,
                        max_abs_err=float((pooled - reference).abs().max()),
                    )
                )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--pooling", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    write_results("quant_lookup", config, rows_for(args), args.out)


if __name__ == "__main__":
    main()
