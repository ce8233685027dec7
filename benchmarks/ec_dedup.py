"""Ids an EmbeddingCollection sends in its input all-to-all, with and without index deduplication.

Run from the repository root: ``python -m benchmarks.ec_dedup [--world 2 --batch 1024 --zipf 1.1]``.

``--world`` CPU ranks (gloo) build one ShardedEmbeddingCollection per sharding type (4 tables x 1e5 rows
x 64, one feature each, 10 ids per sample drawn from a Zipf law with exponent ``--zipf``), once with
``set_ec_index_dedup(False)`` and once with ``True``, run the input dist of one batch per rank and count
the ids each sends (the KJT all-to-all's values; the lengths it sends have the same size either way).
Counts, hence bytes (8 per int64 id), are deterministic for a given seed: no timings here. The
output all-to-all returns one ``[64]`` fp32 row per id sent, so it shrinks in the same proportion.
"""

from __future__ import annotations

import argparse
import copy
from typing import Dict, List

import torch

from benchmarks.common import write_results

TABLES, ROWS, DIM, IDS_PER_SAMPLE = 4, 100_000, 64, 10
TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel"]


def _zipf_batch(rank: int, batch: int, exponent: float):
    from shardkit.sparse import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1234 + rank)
    p = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** exponent
    ids = torch.multinomial(p, TABLES * batch * IDS_PER_SAMPLE, replacement=True, generator=gen)
    keys = [f"f{t}" for t in range(TABLES)]
    lengths = torch.full((TABLES * batch,), IDS_PER_SAMPLE, dtype=torch.int64)
    return KeyedJaggedTensor(keys, ids, lengths=lengths)


def _ids_sent(module, kjt) -> int:
    ctx = module.create_context()
    module.input_dist(ctx, kjt).wait().wait()
    return sum(sum(c.input_splits) for c in ctx.sharding_contexts if c.input_splits is not None)


def _worker(batch: int, exponent: float) -> List[Dict]:
    import torch.distributed as dist

    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.modules import EmbeddingCollection, EmbeddingConfig, FusedOptimizerConfig, OptimType
    from shardkit.sharding import sharding_plan as sp
    from shardkit.sharding.ec_index_dedup import set_ec_index_dedup
    from shardkit.sharding.embedding import EmbeddingCollectionSharder

    rank, world = dist.get_rank(), dist.get_world_size()
    module = EmbeddingCollection(
        [EmbeddingConfig(ROWS, DIM, name=f"t{t}", feature_names=[f"f{t}"]) for t in range(TABLES)],
        device=torch.device("meta"),
        fused_optimizer=FusedOptimizerConfig(OptimType.SGD, lr=0.1),
    )
    kjt = _zipf_batch(rank, batch, exponent)
    gens = {
        "table_wise": lambda t: sp.table_wise(rank=t % world),
        "row_wise": lambda t: sp.row_wise(),
        "column_wise": lambda t: sp.column_wise(ranks=list(range(world))),
        "table_row_wise": lambda t: sp.table_row_wise(host_index=0),
        "table_column_wise": lambda t: sp.table_column_wise(host_index=0),
        "data_parallel": lambda t: sp.data_parallel(),
    }
    rows = []
    for kind in TYPES:
        plan = sp.construct_module_sharding_plan(
            module, {f"t{t}": gens[kind](t) for t in range(TABLES)}, world, world
        )
        sent = {}
        for on in (False, True):
            set_ec_index_dedup(on)
            try:
                sharded = EmbeddingCollectionSharder().shard(
                    copy.deepcopy(module), plan, ShardingEnv.from_process_group(None), torch.device("cpu")
                )
                sent[on] = _ids_sent(sharded, kjt)
            finally:
                set_ec_index_dedup(False)
        rows.append(
            {
                "sharding": kind,
                "rank": rank,
                "ids_sent": sent[False],
                "ids_sent_dedup": sent[True],
                "bytes_saved": 8 * (sent[False] - sent[True]),
                "fraction_sent": round(sent[True] / max(sent[False], 1), 4),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from shardkit.testing import run_world

    per_rank = run_world(_worker, args.world, args.batch, args.zipf)
    rows = [row for rank_rows in per_rank for row in rank_rows if row["rank"] == 0]
    config = {
        "world": args.world,
        "batch_per_rank": args.batch,
        "zipf": args.zipf,
        "tables": TABLES,
        "rows": ROWS,
        "dim": DIM,
        "ids_per_sample": IDS_PER_SAMPLE,
    }
    write_results("ec_dedup", config, rows, args.out)


if __name__ == "__main__":
    main()
