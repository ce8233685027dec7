"""``shardkit run [--as-torchrec] script.py [args]``: run a script on one process.

The script runs as ``python script.py args`` would, through :mod:`shardkit.cli.script_runner` (as each
rank of ``shardkit launch`` does: a finite default timeout, a clean end). ``--as-torchrec`` runs it in
the run-as-torchrec mode (shardkit.cli.torchrec_mode): ``import torchrec`` / ``import fbgemm_gpu``
resolve to shardkit in the script's process and in every Python process it starts; one line on stderr
says so. Without the option nothing is aliased.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from shardkit.cli import torchrec_mode

PROG = "shardkit run"
USAGE = "shardkit run [--as-torchrec] [--timeout S] script.py [script args]"


def _one_line_error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def script_environment(as_torchrec: bool, timeout, prog: str, error) -> dict:
    """The environment of the script's process(es): the mode's variables when asked, the
    ``--timeout`` as ``SHARDKIT_TIMEOUT``; prints the mode's one line on stderr."""
    env = dict(os.environ)
    if timeout is not None:
        from shardkit.distributed.timeouts import ENV_VAR, parse_timeout

        try:
            env[ENV_VAR] = str(parse_timeout(timeout, "--timeout"))
        except ValueError as err:
            error(str(err))
    if as_torchrec:
        env = torchrec_mode.mode_environment(env)
        print(torchrec_mode.NOTICE, file=sys.stderr)
        sys.stderr.flush()
    return env


def run(args) -> int:
    if args.script is None:
        _one_line_error(f"name the script to run: {USAGE}")
    if not os.path.isfile(args.script):
        _one_line_error(f"no such script: {args.script}")
    env = script_environment(args.as_torchrec, args.timeout, PROG, _one_line_error)
    command = [sys.executable, "-m", "shardkit.cli.script_runner", args.script, *args.script_args]
    return subprocess.call(command, env=env)


def add_as_torchrec_option(parser) -> None:
    parser.add_argument(
        "--as-torchrec",
        action="store_true",
        help="run-as-torchrec mode: `import torchrec` and `import fbgemm_gpu` resolve to shardkit in the "
        "script's processes and the processes they start (docs/names.md)",
    )


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "run", help="run a script on one process (optionally as torchrec)", usage=USAGE
    )
    parser.error = _one_line_error
    add_as_torchrec_option(parser)
    parser.add_argument("--timeout", help="seconds a collective may wait (SHARDKIT_TIMEOUT, default 600)")
    parser.add_argument("script", nargs="?", help="python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(run=run)
