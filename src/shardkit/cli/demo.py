"""``shardkit demo``: the library's main job on local ranks, checked against an unsharded run.

``--model dlrm`` (default, :mod:`shardkit.cli.demo_dlrm`): plan, shard and train a recommender.
``--model gnn`` (:mod:`shardkit.cli.demo_gnn`): graph-parallel message passing.

Bad input ends in one line on stderr and exit code 2, before any process starts: a user mistyping an
option should read what is wrong, not a usage block or a traceback from a rank.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, Optional

PROG = "shardkit demo"
# More ranks than this per CPU core only measures the scheduler; the demo refuses them.
MAX_RANKS_PER_CPU = 4
MAX_TABLES = 100
MAX_BATCH = 65_536
SHARDING_TYPES = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
)


def _one_line_error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args) -> str:
    """The first problem with the options (in words), or an empty string."""
    import torch
    import torch.distributed as dist

    cpus = os.cpu_count() or 1
    if args.nproc < 1:
        return f"--nproc must be >= 1, got {args.nproc}"
    if args.device == "cpu" and args.nproc > MAX_RANKS_PER_CPU * cpus:
        return f"--nproc {args.nproc} is more than {MAX_RANKS_PER_CPU} ranks per CPU core ({cpus} cores here)"
    if args.device == "cuda":
        if args.model == "gnn":
            return "--model gnn runs on CPU ranks only; drop --device cuda"
        if getattr(args, "quantize", False):
            return "--quantize serves on CPU ranks only; drop --device cuda"
        if getattr(args, "serve", False):
            return "--serve serves on CPU only; drop --device cuda"
        if getattr(args, "offload", False):
            return "--offload keeps the table in a file-backed tier on CPU ranks only; drop --device cuda"
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            return "--device cuda needs CUDA and NCCL, and this torch build or machine has neither"
        if args.nproc > torch.cuda.device_count():
            return f"--nproc {args.nproc} is more than the {torch.cuda.device_count()} CUDA devices here"
    if args.tolerance is not None and not args.tolerance >= 0:
        return f"--tolerance must be >= 0, got {args.tolerance}"
    if args.timeout is not None and not 0 < args.timeout < float("inf"):
        return f"--timeout must be a positive number of seconds, got {args.timeout}"
    if args.checkpoint is not None:
        if args.model == "gnn":
            return "--checkpoint is for --model dlrm"
        if os.path.exists(args.checkpoint) and not os.path.isdir(args.checkpoint):
            return f"--checkpoint {args.checkpoint} exists and is not a directory"
    if args.model == "gnn" and getattr(args, "offload", False):
        return "--offload is for --model dlrm"
    if args.model == "gnn" and getattr(args, "serve", False):
        return "--serve is for --model dlrm"
    if args.model == "gnn":
        from shardkit.cli import demo_gnn

        return demo_gnn.check_args(args)
    if args.steps < 1:
        return f"--steps must be >= 1, got {args.steps}"
    if not 1 <= args.tables <= MAX_TABLES:
        return f"--tables must be between 1 and {MAX_TABLES}, got {args.tables}"
    if not 1 <= args.batch_size <= MAX_BATCH:
        return f"--batch-size must be between 1 and {MAX_BATCH}, got {args.batch_size}"
    if getattr(args, "offload", False) and args.sharding_type == "data_parallel":
        return "--offload needs a table that is not data-parallel; drop --sharding-type data_parallel"
    if args.mc_slots < 0:
        return f"--mc-slots must be >= 0, got {args.mc_slots}"
    if args.max_rows is not None and args.max_rows < 1:
        return f"--max-rows must be >= 1, got {args.max_rows}"
    return ""


def timeout_env(args) -> Optional[Dict[str, str]]:
    """The ranks' ``SHARDKIT_TIMEOUT`` from ``--timeout`` (None: the environment's, else the default)."""
    return None if args.timeout is None else {"SHARDKIT_TIMEOUT": str(args.timeout)}


def run(args) -> int:
    problem = check_args(args)
    if problem:
        _one_line_error(problem)
    if args.model == "gnn":
        from shardkit.cli import demo_gnn

        return demo_gnn.run(args)
    from shardkit.cli import demo_dlrm

    return demo_dlrm.run(args)


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "demo",
        help="shard and train a model on local ranks and check it against the unsharded model",
        description="Shard and train a model on local ranks; check it against the unsharded model.",
    )
    parser.error = _one_line_error  # argparse's own errors (bad choice, not an int) in one line too
    parser.add_argument("--model", choices=("dlrm", "gnn"), default="dlrm", help="default dlrm")
    parser.add_argument("--nproc", type=int, default=2, help="number of local ranks (default 2)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo, default) or cuda (NCCL)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tolerance", type=float, help="max abs difference allowed (default 1e-4 dlrm, 1e-9 gnn)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        help="seconds a collective may wait for a silent rank before every rank fails naming it "
        "(sets SHARDKIT_TIMEOUT for the ranks; default: SHARDKIT_TIMEOUT, else 120)",
    )
    dlrm = parser.add_argument_group("dlrm")
    dlrm.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    dlrm.add_argument("--tables", type=int, default=8, help="embedding tables (default 8)")
    dlrm.add_argument("--batch-size", type=int, default=256, help="samples per rank and step (default 256)")
    dlrm.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="save the trained model there (shardkit.checkpoint), restore it on another number of ranks, "
        "check it is exact",
    )
    dlrm.add_argument("--max-rows", type=int, help="cap every table's rows (default: no cap, up to 100,000)")
    dlrm.add_argument(
        "--sharding-type",
        choices=SHARDING_TYPES,
        metavar="TYPE",
        help=f"shard every table this way instead of planning: {', '.join(SHARDING_TYPES)}",
    )
    dlrm.add_argument(
        "--quantize",
        action="store_true",
        help="then serve the trained model with int8 / int4 tables, sharded: memory, predictions vs fp32",
    )
    dlrm.add_argument(
        "--serve",
        action="store_true",
        help="then package the trained model (int8 tables), load it in a fresh process, answer requests "
        "batched into KJTs: latency percentiles, requests/s, answers checked against the fp32 model",
    )
    dlrm.add_argument(
        "--offload",
        action="store_true",
        help="offload the largest table (fused_uvm_caching: rows in a backing file, a cache of 5%% of them "
        "in RAM); prints hit rate and bytes moved, and checks it exact like the others",
    )
    dlrm.add_argument(
        "--mc-slots",
        type=int,
        default=4096,
        help="rows of the table behind the raw 64-bit-id feature (managed collision; 0, --quantize or "
        "--serve: none)",
    )
    gnn = parser.add_argument_group("gnn")
    gnn.add_argument("--nodes", type=int, default=200, help="graph nodes (default 200)")
    gnn.add_argument("--edges", type=int, default=1000, help="graph edges (default 1000)")
    parser.set_defaults(run=run)
