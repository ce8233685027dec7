"""One rank of ``shardkit launch``: run the user's script, then end the process without finalization.

``python -m shardkit.cli.script_runner SCRIPT [ARGS]`` runs SCRIPT as ``python SCRIPT ARGS`` would
(``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]`` = the script's directory), with two
differences that keep a correct script from ending in torch's "terminate called without an active
exception" abort (docs/running.md):

- before the script: ``torch._dynamo`` and ``torch.distributed.checkpoint`` are imported. Imported
  after ``init_process_group`` (``torch.optim`` imports ``torch._dynamo`` on an optimizer's first
  step), each keeps the default group alive after ``destroy_process_group``;
- ``SHARDKIT_TIMEOUT`` (seconds; 600 when unset) is the default timeout of the script's
  ``init_process_group`` (a script that passes ``timeout=`` keeps its own), and a collective that
  times out (here, or on a peer that then closed its connections) is reported naming the ranks that
  went silent (``shardkit.distributed.timeouts.naming_silent_ranks``);
- after it: the atexit handlers run, a default group the script left is destroyed, the output is
  flushed and the process ends with ``os._exit``, skipping the interpreter's finalization, during
  which a group's gloo threads that are still alive abort the process.

The exit code is the script's: 0, its ``sys.exit`` code, or 1 after an uncaught exception (printed).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback


def _exit_code(err: SystemExit) -> int:
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)  # sys.exit("message"), as Python prints it
    return 1


def _default_timeout_from_env() -> None:
    """``SHARDKIT_TIMEOUT``, else ``DEFAULT_TIMEOUT_S`` (600 s), as the timeout ``init_process_group``
    and ``new_group`` use when given none (torch reads these module defaults at each call); torch's
    own defaults are 30 minutes (gloo) and 10 (NCCL)."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    from shardkit.distributed.timeouts import DEFAULT_TIMEOUT_S, timeout_from_env

    timeout = timeout_from_env(timedelta(seconds=DEFAULT_TIMEOUT_S))
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m shardkit.cli.script_runner SCRIPT [ARGS]", file=sys.stderr)
        os._exit(2)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    from shardkit.cli.torchrec_mode import install_if_asked

    install_if_asked()  # a rank of `shardkit launch --as-torchrec` (its sitecustomize did it already)
    import torch._dynamo  # noqa: F401 - before the script's init_process_group, see the docstring
    import torch.distributed.checkpoint  # noqa: F401

    from shardkit.distributed.timeouts import naming_silent_ranks

    code = 0
    try:
        _default_timeout_from_env()
        # leaving: a script that fails on its own marks this rank so, and the ranks its closed
        # connections cut off raise their own error at once instead of naming it silent
        with naming_silent_ranks(leaving=True):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as err:
        code = _exit_code(err)
    except BaseException:  # noqa: BLE001 - reported as Python would, then the same exit code
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - still end the process below
        traceback.print_exc()
        code = code or 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
