"""``shardkit`` command-line entry point: dispatches to one module per sub-command."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import shardkit
from shardkit.cli import bench, demo, env_report, launch, plan, port, run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardkit", description="Model-parallel building blocks for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"shardkit {shardkit.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (demo, env_report, run, launch, port, plan, bench):
        module.add_parser(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
