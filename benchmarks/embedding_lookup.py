"""Pooled embedding lookup: bandwidth vs a memory copy of the same bytes, and the grouped (table-
batched) lookup vs one ``nn.EmbeddingBag`` call per table.

Run from the repository root: ``python -m benchmarks.embedding_lookup [--batch 2048 --pooling 32]``.

Part 1, for tables of 1e5 to 1e7 rows: the grouped lookup of one table (random ids, SUM pooling) and the
fused backward + SGD update, with the native C++ kernels and with the pure-torch path. ``GB/s`` counts the
bytes the operation must move per second (forward: the rows read, ids x dim x element size; backward +
update: the output gradient once plus each distinct row read and written once); ``memcpy_GB/s`` is a
``copy_`` of a tensor of exactly that many bytes on the same machine, in the same run; their ratio is how
close the operation gets to the physical limit of moving those bytes. Random rows of a large table come
from DRAM while the copy streams, so expect the ratio to fall as the table grows.

Part 2, many tables (16 large tables and a big batch; 64 small tables and a small batch): an
EmbeddingBagCollection (one kernel call per group of equal-dim tables) vs a loop of ``nn.EmbeddingBag``
modules, forward alone, and a training step: fused SGD in the backward vs dense gradients +
``torch.optim.SGD``, and vs sparse gradients + ``torch.optim.SGD``.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from benchmarks.common import median_seconds, write_results
from shardkit.distributed.validation import set_validation, validation_enabled
from shardkit.kernels import RowOptimizerArgs, embedding_fused_backward, kernel_backend, native_ops
from shardkit.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedOptimizerConfig,
    GroupedEmbeddingLookup,
    ShardSpec,
)
from shardkit.sparse import KeyedJaggedTensor


def _bags(num_rows: int, batch: int, pooling: int, gen: torch.Generator):
    """Fixed-length bags of uniform random ids: ids [batch * pooling], offsets [batch + 1]."""
    ids = torch.randint(0, num_rows, (batch * pooling,), generator=gen)
    offsets = torch.arange(0, batch * pooling + 1, pooling)
    return ids, offsets


def bandwidth_rows(batch: int, pooling: int, dim: int, num_rows: int, repeats: int) -> List[Dict[str, Any]]:
    """One table of ``num_rows``: forward and fused backward + SGD of each kernel backend vs a copy.

    Forward bytes: the rows read (ids x dim x 4). Backward + update bytes: the output gradient read once
    and each distinct row read and written once (bags x dim x 4 + 2 x distinct x dim x 4), the least
    that a fused update must move. Each is compared with a ``copy_`` of exactly that many bytes.
    """
    config = EmbeddingBagConfig(num_embeddings=num_rows, embedding_dim=dim, name="t", feature_names=["f"])
    lookup = GroupedEmbeddingLookup([ShardSpec(config)], pooled=True)
    weight = lookup.weight.detach()
    ids, offsets = _bags(num_rows, batch, pooling, torch.Generator().manual_seed(0))
    grad = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1))
    item = weight.element_size()
    fwd_bytes = ids.numel() * dim * item
    bwd_bytes = grad.numel() * 4 + 2 * ids.unique().numel() * dim * item
    copy_s = {n: _copy_seconds(n, repeats) for n in (fwd_bytes, bwd_bytes)}
    sgd = RowOptimizerArgs("SGD", lr=1e-9)  # a tiny step: the table stays what it was
    rows = []
    backends = ["native", "torch"] if native_ops() is not None else ["torch"]
    with torch.no_grad():
        for backend in backends:
            with kernel_backend(backend):
                for checked in (True, False):
                    set_validation(checked)
                    seconds = median_seconds(lambda: lookup(ids, offsets, [batch]), repeats=repeats)
                    rows.append(
                        _bandwidth_row(
                            f"forward {num_rows:.0e} rows, {backend}" + ("" if checked else ", unchecked"),
                            num_rows,
                            ids,
                            seconds,
                            fwd_bytes,
                            copy_s[fwd_bytes],
                        )
                    )
                seconds = median_seconds(
                    lambda: embedding_fused_backward(weight, ids, offsets, None, None, None, grad, True, sgd),
                    repeats=repeats,
                )
                rows.append(
                    _bandwidth_row(
                        f"fused backward + SGD {num_rows:.0e} rows, {backend}",
                        num_rows,
                        ids,
                        seconds,
                        bwd_bytes,
                        copy_s[bwd_bytes],
                    )
                )
    return rows


def _copy_seconds(num_bytes: int, repeats: int) -> float:
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return median_seconds(lambda: dst.copy_(src), repeats=repeats)


def _bandwidth_row(name, num_rows, ids, seconds, num_bytes, copy_seconds) -> Dict[str, Any]:
    return {
        "name": name,
        "rows": num_rows,
        "ids": ids.numel(),
        "ms": seconds * 1e3,
        "Mlookups/s": ids.numel() / seconds / 1e6,
        "GB/s": num_bytes / seconds / 1e9,
        "memcpy_GB/s": num_bytes / copy_seconds / 1e9,
        "ratio_to_memcpy": copy_seconds / seconds,
    }


def _many_tables(num_tables: int, num_rows: int, dim: int) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=num_rows, embedding_dim=dim, name=f"t{i}", feature_names=[f"f{i}"])
        for i in range(num_tables)
    ]


def _naive_bags(ebc: EmbeddingBagCollection, sparse: bool) -> nn.ModuleList:
    bags = nn.ModuleList()
    for table in ebc.embedding_bag_configs():
        bag = nn.EmbeddingBag(table.num_embeddings, table.embedding_dim, mode="sum", sparse=sparse)
        bag.weight.data.copy_(ebc.table_weight(table.name))
        bags.append(bag)
    return bags


def grouped_rows(
    batch: int, pooling: int, dim: int, num_tables: int, num_rows: int, repeats: int
) -> List[Dict[str, Any]]:
    tables = _many_tables(num_tables, num_rows, dim)
    gen = torch.Generator().manual_seed(1)
    per_table = [_bags(num_rows, batch, pooling, gen) for _ in tables]
    features = KeyedJaggedTensor.from_lengths_sync(
        [t.feature_names[0] for t in tables],
        torch.cat([ids for ids, _ in per_table]),
        torch.full((num_tables * batch,), pooling),
    )
    ebc = EmbeddingBagCollection(tables)
    fused = EmbeddingBagCollection(tables, fused_optimizer=FusedOptimizerConfig("SGD", lr=0.01))
    dense_bags, sparse_bags = _naive_bags(ebc, sparse=False), _naive_bags(ebc, sparse=True)
    dense_opt = torch.optim.SGD(dense_bags.parameters(), lr=0.01)
    sparse_opt = torch.optim.SGD(sparse_bags.parameters(), lr=0.01)

    def naive_forward(bags):
        return torch.cat([bag(ids, offsets[:-1]) for bag, (ids, offsets) in zip(bags, per_table)], dim=1)

    def naive_step(bags, optimizer):
        naive_forward(bags).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    set_validation(True)
    with torch.no_grad():
        naive_fwd = median_seconds(lambda: naive_forward(dense_bags), repeats=repeats)
        ebc_fwd = median_seconds(lambda: ebc(features), repeats=repeats)
        set_validation(False)
        ebc_fwd_unchecked = median_seconds(lambda: ebc(features), repeats=repeats)
    set_validation(True)
    naive_dense_step = median_seconds(lambda: naive_step(dense_bags, dense_opt), repeats=repeats)
    naive_sparse_step = median_seconds(lambda: naive_step(sparse_bags, sparse_opt), repeats=repeats)
    fused_step = median_seconds(lambda: fused(features).values().sum().backward(), repeats=repeats)

    ids = num_tables * batch * pooling
    config = f"{num_tables} tables x {num_rows:.0e} rows, B={batch}, L={pooling}"
    return [
        {"name": f"[{config}] naive forward", "ms": naive_fwd * 1e3, "Mlookups/s": ids / naive_fwd / 1e6},
        {
            "name": "grouped EBC forward",
            "ms": ebc_fwd * 1e3,
            "Mlookups/s": ids / ebc_fwd / 1e6,
            "speedup_vs_naive": naive_fwd / ebc_fwd,
        },
        {
            "name": "grouped EBC forward, unchecked",
            "ms": ebc_fwd_unchecked * 1e3,
            "Mlookups/s": ids / ebc_fwd_unchecked / 1e6,
            "speedup_vs_naive": naive_fwd / ebc_fwd_unchecked,
        },
        {"name": "naive train step, dense grad + SGD", "ms": naive_dense_step * 1e3},
        {
            "name": "naive train step, sparse grad + SGD",
            "ms": naive_sparse_step * 1e3,
            "speedup_vs_naive": naive_dense_step / naive_sparse_step,
        },
        {
            "name": "fused SGD train step (EBC)",
            "ms": fused_step * 1e3,
            "speedup_vs_naive": naive_dense_step / fused_step,
        },
    ]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--pooling", type=int, default=32, help="ids per bag")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e5, 1e6, 1e7], help="table rows")
    parser.add_argument("--tables", type=int, default=16, help="tables in the grouped-vs-naive part")
    parser.add_argument("--table-rows", type=int, default=100_000)
    parser.add_argument(
        "--small-tables", type=int, default=64, help="second grouped-vs-naive case: many small tables"
    )
    parser.add_argument("--small-batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads; 1 by default because on a shared machine an OpenMP thread waiting for a "
        "busy core makes small ops orders of magnitude slower, which would swamp every ratio",
    )
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    previous = validation_enabled()
    try:
        rows = []
        for size in args.sizes:
            rows += bandwidth_rows(args.batch, args.pooling, args.dim, int(size), args.repeats)
        rows += grouped_rows(
            args.batch, args.pooling // 2, args.dim, args.tables, args.table_rows, args.repeats
        )
        # the case table batching exists for: many features, each a small amount of work per call
        rows += grouped_rows(args.small_batch, 4, args.dim, args.small_tables, 10_000, args.repeats)
    finally:
        set_validation(previous)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["dtype"] = "fp32"
    write_results("embedding_lookup", config, rows, args.out)


if __name__ == "__main__":
    main()
