"""The package's layers import downwards only (docs/design.md): each subpackage's imports of other
shardkit subpackages, read from the source, go to subpackages of a lower rank.

The one exception is torchrec's module tree (docs/design.md, "torchrec's module tree"): the modules at
torchrec's paths (``shardkit/distributed/embeddingbag.py``, ...) are faces that only re-export names
defined elsewhere, so they may import from any layer; in return nothing inside shardkit imports them."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "shardkit"

# docs/design.md's picture, with the order inside a layer where one subpackage uses another
RANK = {
    "kernels": 0,
    "distributed": 0,
    "sparse": 0,
    "losses": 1,
    "graph_parallel": 1,
    "modules": 1,
    "optim": 1.2,  # its combined and warm-up optimizers build on modules.optimizer_facade
    "datasets": 1,
    "distill": 1.5,  # its losses use shardkit.losses
    "models": 1.5,  # models of modules, fed by datasets
    "quant": 2,
    "sharding": 2.5,  # shards the quantized modules too (torchrec.distributed.quant_embeddingbag)
    "fbgemm_gpu": 2.7,  # fbgemm's Python names of the run-as-torchrec mode (OptimType, cache_params)
    "planner": 3,
    "model_parallel": 4,
    "checkpoint": 4,
    "inference": 4.5,  # serving: quantizes, plans, shards (model_parallel) and packages a trained model
    "pipeline": 5,
    "testing": 8,  # the multi-rank harness, which the CLI demos run on
    "cli": 9,
}


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The parsed source of ``path``, parsed once for all the tests of this file (read-only)."""
    return ast.parse(path.read_text())


def _imported_subpackages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(_tree(path)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found.update(n.split(".")[1] for n in names if n.startswith("shardkit.") and n.count(".") >= 1)
    return found


def test_every_subpackage_has_a_rank():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(RANK), "give a new subpackage its place in RANK and in docs/design.md"


def _is_face(tree: ast.Module) -> bool:
    """A module of torchrec's tree: its docstring opens with "torchrec's ``torchrec.<path>`` in shardkit."."""
    first_line = (ast.get_docstring(tree) or "").split("\n")[0]
    return re.fullmatch(r"torchrec's ``torchrec[\w.]*`` in shardkit\.", first_line) is not None


def _holds_no_logic(tree: ast.Module) -> bool:
    """Only a docstring, ``from shardkit... import`` lines, ``__all__`` and ``__getattr__ = absent(...)``."""
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardkit."):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__getattr__"]
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "absent"
        ):
            continue
        return False
    return True


def _module_name(path: Path) -> str:
    parts = ("shardkit",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _faces() -> set[str]:
    return {_module_name(p) for p in PACKAGE.rglob("*.py") if _is_face(_tree(p))}


def test_imports_go_downwards_only():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:
            continue  # shardkit/__init__.py: the top-level names, imported lazily
        if _is_face(_tree(path)):
            continue  # torchrec's module tree: re-exports only (the test below)
        here = parts[0]
        for there in _imported_subpackages(path) - {here}:
            if RANK[there] >= RANK[here]:
                upward.append(f"{path.relative_to(PACKAGE)} imports shardkit.{there}")
    assert not upward, "\n".join(sorted(upward))


def test_torchrecs_module_tree_holds_no_logic():
    faces = [p for p in PACKAGE.rglob("*.py") if _is_face(_tree(p))]
    assert len(faces) > 30
    with_logic = [str(p.relative_to(PACKAGE)) for p in faces if not _holds_no_logic(_tree(p))]
    assert not with_logic, f"modules of torchrec's tree only re-export: {with_logic}"


def test_nothing_inside_shardkit_imports_torchrecs_module_tree():
    """The faces at torchrec's paths are for users; shardkit's own code imports the defining modules
    (which keeps the layers honest: a face may import from any layer)."""
    faces = _faces()
    assert "shardkit.distributed.embeddingbag" in faces and "shardkit.distributed.planner.types" in faces
    users = []
    for path in PACKAGE.rglob("*.py"):
        if _module_name(path) in faces:
            continue  # a face package's __init__ may re-export its own faces
        for node in ast.walk(_tree(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            users += [f"{path.relative_to(PACKAGE)} imports {n}" for n in names if n in faces]
    assert not users, "\n".join(sorted(users))


def test_lazy_torchrec_names_of_a_layer_package_come_from_faces():
    """``shardkit.distributed`` (L0) offers torchrec.distributed's names from higher layers only through
    the faces, read on first use, so importing it never imports a higher layer."""
    import shardkit.distributed

    faces = _faces()
    assert set(shardkit.distributed._TORCHREC_NAMES.values()) <= faces
