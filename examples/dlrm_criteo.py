"""Train a sharded DLRM on click logs in the Criteo Kaggle TSV format.

    python examples/dlrm_criteo.py --generate /tmp/criteo.tsv --rows 20000   # a small look-alike file
    torchrun --nproc-per-node 2 examples/dlrm_criteo.py --data /tmp/criteo.tsv --steps 200
    python examples/dlrm_criteo.py --data /tmp/criteo.tsv --steps 200          # one process

The format is the Criteo Display Advertising Challenge's ``train.txt``: one sample per line, tab
separated, a 0/1 label, 13 integer features ``I1..I13`` and 26 categorical features ``C1..C26`` given
as 32-bit hashes in hex (``68fd1e64``); any feature may be missing (an empty field). Integer features
become ``log(1 + max(x, 0))`` (0 when missing); a categorical value is hashed into its table
(``int(hex, 16) % --table-rows``) and a missing one is an empty bag, which the jagged input represents
as it is.

The model (``shardkit.models.MixedDimDLRM``, the one ``shardkit demo`` trains) is built on the meta
device, so no rank ever holds an unsharded table; the planner chooses how to shard the 26 tables,
``DistributedModelParallel`` shards them and initializes the local shards, and
``TrainPipelineSparseDist`` trains. Rank ``r`` of ``n`` reads lines ``r, r + n, r + 2n, ...`` and starts
over at the end of the file, so every rank draws the same number of batches.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from typing import Iterator, List, Optional, Sequence

import torch
import torch._dynamo  # noqa: F401 - before init_process_group (torch.optim imports it later): docs/running.md
import torch.distributed as dist

from shardkit.datasets import Batch, TableSpec
from shardkit.model_parallel import CombinedOptimizer, DistributedModelParallel
from shardkit.models import MixedDimDLRM
from shardkit.pipeline import TrainPipelineSparseDist
from shardkit.planner import EmbeddingShardingPlanner, Topology
from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
from shardkit.sparse import KeyedJaggedTensor

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]


def generate(path: str, rows: int, seed: int = 0) -> None:
    """Write ``rows`` samples in the Criteo TSV format whose labels depend on the features.

    Each categorical column has its own vocabulary of hex hashes (10 to 10,000 values, drawn with a
    Zipf-like skew) and a hidden click propensity per value; counts are Poisson-like; 10% of the
    fields are missing. The label is drawn from the sigmoid of the propensities and two counts.
    """
    rng = random.Random(seed)
    vocab_sizes = [10 ** (1 + j % 4) for j in range(NUM_SPARSE)]
    vocabs = [[f"{rng.getrandbits(32):08x}" for _ in range(v)] for v in vocab_sizes]
    propensity = [[rng.gauss(0, 1.5) for _ in range(v)] for v in vocab_sizes]
    with open(path, "w") as f:
        for _ in range(rows):
            ints = [int(rng.expovariate(1 / (1 + 3 * j))) for j in range(NUM_DENSE)]
            score = 2.5 * (math.log1p(ints[0]) - 0.6) - 2.0 * (math.log1p(ints[1]) - 1.3)
            cats = []
            for j in range(NUM_SPARSE):
                k = min(int(rng.paretovariate(1.0)) - 1, vocab_sizes[j] - 1)
                score += propensity[j][k] if j < 8 else 0.0  # the first columns carry the signal
                cats.append(vocabs[j][k])
            label = int(rng.random() < 1 / (1 + math.exp(-score)))
            fields = [str(v) for v in ints] + cats
            fields = ["" if rng.random() < 0.1 else v for v in fields]
            f.write("\t".join([str(label), *fields]) + "\n")


def parse_line(line: str, table_rows: int) -> tuple:
    """``(label, [13] dense floats, [26] ids or None)`` of one TSV line."""
    fields = line.rstrip("\n").split("\t")
    if len(fields) != 1 + NUM_DENSE + NUM_SPARSE:
        raise ValueError(f"expected {1 + NUM_DENSE + NUM_SPARSE} tab-separated fields, got {len(fields)}")
    dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1 : 1 + NUM_DENSE]]
    ids = [int(v, 16) % table_rows if v else None for v in fields[1 + NUM_DENSE :]]
    return float(fields[0]), dense, ids


def make_batch(samples: Sequence[tuple]) -> Batch:
    """One batch from parsed samples: a missing categorical value is an empty bag."""
    labels = torch.tensor([s[0] for s in samples])
    dense = torch.tensor([s[1] for s in samples])
    lengths, values = [], []
    for j in range(NUM_SPARSE):  # KJT layout: key-major, then sample
        for s in samples:
            lengths.append(0 if s[2][j] is None else 1)
            if s[2][j] is not None:
                values.append(s[2][j])
    kjt = KeyedJaggedTensor(
        SPARSE_NAMES, torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths)
    )
    return Batch(dense, kjt, labels)


def read_batches(path: str, batch_size: int, table_rows: int, rank: int, world: int) -> Iterator[Batch]:
    """This rank's batches, forever: lines ``rank, rank + world, ...``, starting over at the end."""
    samples: List[tuple] = []
    while True:
        seen = 0
        with open(path) as f:
            for index, line in enumerate(f):
                if index % world != rank:
                    continue
                seen += 1
                try:
                    samples.append(parse_line(line, table_rows))
                except ValueError as err:
                    raise ValueError(f"{path}, line {index + 1}: {err}") from None
                if len(samples) == batch_size:
                    yield make_batch(samples)
                    samples = []
        if seen == 0:
            raise ValueError(f"{path} has no line for rank {rank} of {world}")


def init_distributed() -> torch.device:
    """The default process group: torchrun's, or a one-rank group for a plain ``python`` run."""
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def train(args) -> None:
    device = init_distributed()
    try:
        train_on(args, device)
    finally:  # also after an error: a group alive at exit can abort the interpreter (docs/running.md)
        dist.destroy_process_group()


def train_on(args, device: torch.device) -> None:
    """Plan, shard and train on the initialized default group; rank 0 prints the plan and the losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tables = [TableSpec(name, args.table_rows, args.dim) for name in SPARSE_NAMES]
    torch.manual_seed(args.seed)
    model = MixedDimDLRM(tables, NUM_DENSE, dense_out=args.dim, lr=args.lr, device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device=device.type), batch_size=args.batch_size
    )
    plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()])
    if rank == 0:
        print(f"{NUM_SPARSE} tables of {args.table_rows:,} x {args.dim} over {world} rank(s)")
        print(planner.last_report, flush=True)
    dmp = DistributedModelParallel(model, device=device, plan=plan)
    dense = torch.optim.SGD(dict(dmp.bare_named_parameters()).values(), lr=args.lr)
    pipeline = TrainPipelineSparseDist(
        dmp, CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)]), device
    )
    data = read_batches(args.data, args.batch_size, args.table_rows, rank, world)
    window = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, steps since the last print
    begin = time.perf_counter()
    for step in range(1, args.steps + 1):
        window += torch.stack([pipeline.progress(data).double(), torch.ones((), device=device).double()])
        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(window)  # the mean over ranks and steps: every rank has equal batches
            if rank == 0:
                print(f"step {step:>5}  loss {(window[0] / window[1]).item():.4f}", flush=True)
            window.zero_()
    seconds = time.perf_counter() - begin
    if rank == 0:
        samples = args.steps * args.batch_size * world
        print(f"trained {samples:,} samples in {seconds:.1f} s: {samples / seconds:,.0f} samples/s")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="Criteo TSV file to train on")
    parser.add_argument("--generate", metavar="FILE", help="write a small look-alike file and exit")
    parser.add_argument("--rows", type=int, default=10_000, help="samples of --generate (default 10,000)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128, help="samples per rank and step")
    parser.add_argument("--table-rows", type=int, default=100_000, help="rows of each hashed table")
    parser.add_argument("--dim", type=int, default=16, help="embedding dimension")
    parser.add_argument("--lr", type=float, default=0.5, help="SGD rate of tables and dense layers")
    parser.add_argument("--log-every", type=int, default=10, help="print the mean loss every N steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.generate:
        generate(args.generate, args.rows, args.seed)
        print(f"wrote {args.rows:,} samples to {args.generate}")
        return 0
    if not args.data:
        parser.error("give --data FILE (or --generate FILE to write one)")
    if min(args.steps, args.batch_size, args.table_rows, args.dim, args.log_every) < 1:
        parser.error("--steps, --batch-size, --table-rows, --dim and --log-every must be >= 1")
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
