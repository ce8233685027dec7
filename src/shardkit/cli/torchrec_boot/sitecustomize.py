"""Imported by Python at start-up in the processes of ``shardkit run / launch --as-torchrec`` (this
directory is first on their ``PYTHONPATH``): installs the run-as-torchrec finder when
``SHARDKIT_AS_TORCHREC`` is ``"1"`` (shardkit.cli.torchrec_mode), then runs the ``sitecustomize`` that
this one shadows, if any, so that the machine's own start-up code still runs."""

import os
import sys


def _boot() -> None:
    if os.environ.get("SHARDKIT_AS_TORCHREC") == "1":
        try:
            from shardkit.cli.torchrec_mode import install

            install()
        except Exception as err:  # noqa: BLE001 - start-up must go on; the script's import will fail clearly
            print(f"shardkit: could not switch the run-as-torchrec mode on: {err!r}", file=sys.stderr)
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        shadowed = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(shadowed)


_boot()
