"""The package's layers import downwards only (docs/design.md): each subpackage's imports of other
shardkit subpackages, read from the source, go to subpackages of a lower rank."""

from __future__ import annotations

import ast
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
    "planner": 3,
    "model_parallel": 4,
    "checkpoint": 4,
    "pipeline": 5,
    "testing": 8,  # the multi-rank harness, which the CLI demos run on
    "cli": 9,
}


def _imported_subpackages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found.update(n.split(".")[1] for n in names if n.startswith("shardkit.") and n.count(".") >= 1)
    return found


def test_every_subpackage_has_a_rank():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(RANK), "give a new subpackage its place in RANK and in docs/design.md"


def test_imports_go_downwards_only():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:
            continue  # shardkit/__init__.py: the top-level names, imported lazily
        here = parts[0]
        for there in _imported_subpackages(path) - {here}:
            if RANK[there] >= RANK[here]:
                upward.append(f"{path.relative_to(PACKAGE)} imports shardkit.{there}")
    assert not upward, "\n".join(sorted(upward))
