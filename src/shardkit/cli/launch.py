"""``shardkit launch -n N script.py ...``: run a script on N local processes with torch's launcher.

A thin wrapper over ``torch.distributed.run`` (torchrun) in standalone mode, so the script sees the
usual RANK / LOCAL_RANK / WORLD_SIZE variables. Each rank runs the script through
:mod:`shardkit.cli.script_runner`, so that a rank whose script is done cannot end in torch's
"terminate called without an active exception" abort. ``--as-torchrec`` runs every rank in the
run-as-torchrec mode (``import torchrec`` resolves to shardkit; shardkit.cli.torchrec_mode).
``--timeout SECONDS`` (or ``SHARDKIT_TIMEOUT``;
600 s when neither is given) becomes the default timeout of the script's ``init_process_group``. For
several machines use torchrun directly.
"""

from __future__ import annotations

import argparse
import os
import sys

PROG = "shardkit launch"
USAGE = "shardkit launch [-n N] [--as-torchrec] [--timeout S] script.py [script args]"


def torchrun_args(nproc: int, script: str, script_args: list[str]) -> list[str]:
    """The torchrun command line that ``shardkit launch`` runs: every rank runs the script through
    ``shardkit.cli.script_runner``, which ends the rank cleanly (docs/running.md)."""
    return [
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "shardkit.cli.script_runner",
        script,
        *script_args,
    ]


def _one_line_error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def run(args) -> int:
    """Runs the script on every rank. Never returns: a failed rank raises torchrun's ChildFailedError,
    and once every rank has succeeded the process ends with ``os._exit(0)``."""
    if args.script is None:
        _one_line_error(f"name the script to run on every rank: {USAGE}")
    if args.nproc < 1:
        _one_line_error(f"-n must be >= 1, got {args.nproc}")
    if not os.path.isfile(args.script):
        _one_line_error(f"no such script: {args.script}")
    from shardkit.cli.run import script_environment

    # torchrun's workers inherit this process' environment
    os.environ.update(script_environment(args.as_torchrec, args.timeout, PROG, _one_line_error))
    from torch.distributed.run import main as torchrun_main

    # torchrun sets 1 thread per rank anyway, with a 4-line warning when the variable is unset
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torchrun_main(torchrun_args(args.nproc, args.script, list(args.script_args)))
    # every rank is done: end here, skipping the interpreter's finalization, which with torch loaded
    # takes a second or more (measured 1.2 s on a loaded 2-core machine) and has nothing left to do
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def add_parser(commands) -> None:
    from shardkit.cli.run import add_as_torchrec_option

    parser = commands.add_parser("launch", help="run a script on N local processes (torchrun)", usage=USAGE)
    parser.error = _one_line_error
    parser.add_argument("-n", "--nproc", type=int, default=2, help="number of local processes (default 2)")
    add_as_torchrec_option(parser)
    parser.add_argument(
        "--timeout",
        help="seconds a collective may wait (SHARDKIT_TIMEOUT, default 600: the default timeout of the "
        "script's init_process_group); a rank that times out names the ranks that went silent",
    )
    parser.add_argument("script", nargs="?", help="python script to run on every rank")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(run=run)
