"""``shardkit launch -n N script.py ...``: run a script on N local processes with torch's launcher.

A thin wrapper over ``torch.distributed.run`` (torchrun) in standalone mode, so the script sees the
usual RANK / LOCAL_RANK / WORLD_SIZE variables. For several machines use torchrun directly.
"""

from __future__ import annotations

import argparse


def torchrun_args(nproc: int, script: str, script_args: list[str]) -> list[str]:
    """The torchrun command line that ``shardkit launch`` runs."""
    return ["--standalone", f"--nproc-per-node={nproc}", script, *script_args]


def run(args) -> int:
    if args.nproc < 1:
        raise SystemExit(f"shardkit launch: -n must be >= 1, got {args.nproc}")
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun_args(args.nproc, args.script, list(args.script_args)))
    return 0


def add_parser(commands) -> None:
    parser = commands.add_parser("launch", help="run a script on N local processes (torchrun)")
    parser.add_argument("-n", "--nproc", type=int, default=2, help="number of local processes")
    parser.add_argument("script", help="python script to run on every rank")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(run=run)
