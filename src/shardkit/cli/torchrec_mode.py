"""The run-as-torchrec mode: ``import torchrec`` and ``import fbgemm_gpu`` resolve to shardkit.

``shardkit run --as-torchrec script.py`` and ``shardkit launch -n N --as-torchrec script.py`` switch it
on for the script's processes and every Python process they start, and for nothing else:

- they set ``SHARDKIT_AS_TORCHREC=1`` and put the directory of ``torchrec_boot/sitecustomize.py`` first
  on ``PYTHONPATH``; that ``sitecustomize`` (which Python imports at start-up, then hands over to the
  ``sitecustomize`` it shadows) calls :func:`install` when the variable is ``"1"``;
- :func:`install` puts an :class:`AliasFinder` first on ``sys.meta_path``: ``torchrec.X.Y`` is the module
  object ``shardkit.X.Y`` (torchrec's module tree, docs/names.md) and ``fbgemm_gpu.X`` is
  ``shardkit.fbgemm_gpu.X``; importing ``torchrec`` or ``fbgemm_gpu`` also registers
  ``torch.ops.fbgemm``'s jagged ops (:mod:`shardkit.fbgemm_gpu.torch_ops`), as importing torchrec loads
  fbgemm's.

Nothing in shardkit installs the finder otherwise: importing shardkit (this module included) leaves
``import torchrec`` alone. The aliases are the same module objects, so ``torchrec.X.Y.Name is
shardkit.X.Y.Name`` and classes keep their ``shardkit`` ``__module__`` (pickles load without the mode).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Dict, List, Optional

ENV_VAR = "SHARDKIT_AS_TORCHREC"

# top-level name a program imports -> the shardkit package at its place
ALIASES: Dict[str, str] = {"torchrec": "shardkit", "fbgemm_gpu": "shardkit.fbgemm_gpu"}

BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrec_boot")

NOTICE = (
    "shardkit: run-as-torchrec mode: `import torchrec` / `import fbgemm_gpu` resolve to shardkit in "
    "this run and the Python processes it starts (docs/names.md)"
)


def target_name(fullname: str) -> Optional[str]:
    """The shardkit module that stands for ``fullname`` (``torchrec.distributed.types`` ->
    ``shardkit.distributed.types``), or None for a module outside the aliased trees."""
    top, dot, rest = fullname.partition(".")
    if top not in ALIASES:
        return None
    return ALIASES[top] + dot + rest


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as the shardkit module itself (no second copy of any module)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # the import system set the alias' spec on the shared module: give it back its own
        module.__spec__ = self._own_spec
        if self.target in ("shardkit", "shardkit.fbgemm_gpu"):
            importlib.import_module("shardkit.fbgemm_gpu.torch_ops")  # as importing fbgemm loads its ops


class AliasFinder(importlib.abc.MetaPathFinder):
    """``sys.meta_path`` finder of the mode: specs for ``torchrec[.X]`` and ``fbgemm_gpu[.X]``."""

    def find_spec(self, fullname: str, path=None, target=None):
        shardkit_name = target_name(fullname)
        if shardkit_name is None:
            return None
        try:
            found = importlib.util.find_spec(shardkit_name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: shardkit has no {shardkit_name} (run-as-torchrec mode; "
                "docs/names.md lists what shardkit covers)",
                name=fullname,
            )
        is_package = found.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(shardkit_name), is_package=is_package)


def installed() -> bool:
    return any(isinstance(finder, AliasFinder) for finder in sys.meta_path)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent). Modules already imported under the
    real names (a real torchrec) are left as they are."""
    if not installed():
        sys.meta_path.insert(0, AliasFinder())


def install_if_asked() -> None:
    """:func:`install` when ``SHARDKIT_AS_TORCHREC`` is ``"1"`` (a launched rank of the mode)."""
    if os.environ.get(ENV_VAR) == "1":
        install()


def mode_environment(environ: Dict[str, str]) -> Dict[str, str]:
    """A copy of ``environ`` with the mode switched on for every Python process started with it."""
    env = dict(environ)
    env[ENV_VAR] = "1"
    paths: List[str] = [BOOT_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
