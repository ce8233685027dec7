"""Write docs/spec_names.md: every public name of the specification and where shardkit has it.

    python tools/spec_names.py ../shared/spec > docs/spec_names.md

Names are collected from the specification documents (fully qualified names of the documented
systems); each is looked up by its last component among the objects defined in shardkit's modules.
A name shardkit does not define is listed as "not in shardkit", so the table is also the list of gaps,
unless ``DELIBERATELY_ABSENT`` gives the reason shardkit leaves it out (rendered in its own section).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from pathlib import Path

import shardkit

ROOTS = r"(?:torchrec|nemo_rl|ocpmodels|megatron|transformer_engine)"
# not preceded by "/" or a word character: skips the names inside documentation URLs
QUALIFIED = re.compile(rf"(?<![/\w]){ROOTS}(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# documented without its qualified name (only as ":class:`AlignmentBatch`")
EXTRA = {"nemo_rl.algorithms.x_token.loss_utils.AlignmentBatch"}

_COMM = "torchrec.distributed.comm_ops."
_LOOKUP = "torchrec.distributed.embedding_lookup."
_COMM_REASON = (
    "torchrec's autograd Functions behind the comm ops; shardkit's collectives are other autograd "
    "Functions behind the same public ops and Info classes (docs/comm_ops.md)"
)
_LOOKUP_REASON = (
    "fbgemm-TBE-specific lookup classes; shardkit's one `ShardedGroupedLookup` / "
    "`QuantShardedGroupedLookup` serve every kernel"
)
_SPLITS_REASON = (
    "internals of torchrec's fused splits exchange in its train pipelines; shardkit's pipelines start "
    "the sharded modules' input dists, whose `KJTAllToAll` does its own two-phase exchange (header "
    "row, then data; docs/sharding.md)"
)
_GROUP_REASON = (
    "a private module-level global; shardkit's gp_utils keeps its groups in one state object "
    "(`_STATE`, reset through the `shardkit.distributed.state` registry; docs/design.md)"
)
# specification name -> why shardkit deliberately does not have it (one line each). The modules at
# torchrec's paths raise a clear ImportError for the torchrec ones (tests/test_torchrec_tree.py, ABSENT).
DELIBERATELY_ABSENT = {
    **{
        _COMM + op + suffix: _COMM_REASON
        for op in (
            "All2All_Pooled",
            "All2Allv",
            "AllGatherBase",
            "ReduceScatterBase",
            "ReduceScatterV",
            "ReduceScatter",
            "Variable_Batch_All2All_Pooled",
        )
        for suffix in ("_Req", "_Wait")
    },
    _COMM + "All2All_Seq_Req": _COMM_REASON,
    _COMM + "All2All_Seq_Req_Wait": _COMM_REASON,
    _COMM
    + "All2AllDenseInfo": "the info of `alltoall_dense`, an op shardkit does not provide (docs/comm_ops.md)",
    **{
        _LOOKUP + name: _LOOKUP_REASON
        for name in (
            "GroupedEmbeddingsLookup",
            "GroupedPooledEmbeddingsLookup",
            "InferGroupedEmbeddingsLookup",
            "InferGroupedLookupMixin",
            "InferGroupedPooledEmbeddingsLookup",
            "MetaInferGroupedEmbeddingsLookup",
            "MetaInferGroupedPooledEmbeddingsLookup",
        )
    },
    "torchrec.distributed.dist_data.SplitsAllToAllAwaitable": _SPLITS_REASON,
    "torchrec.distributed.embedding_sharding.FusedKJTListSplitsAwaitable": _SPLITS_REASON,
    "torchrec.distributed.embedding_sharding.KJTSplitsAllToAllMeta": _SPLITS_REASON,
    "torchrec.distributed.train_pipeline.FusedKJTListSplitsAwaitable": _SPLITS_REASON,
    "torchrec.distributed.train_pipeline.KJTAllToAllForward": _SPLITS_REASON,
    "torchrec.distributed.train_pipeline.KJTSplitsAllToAllMeta": _SPLITS_REASON,
    "torchrec.distributed.train_pipeline.SplitsAllToAllAwaitable": _SPLITS_REASON,
    "torchrec.distributed.embeddingbag.VariableBatchEmbeddingBagCollectionAwaitable": (
        "a variable batch per feature takes the sharded collection's ordinary output path (the "
        '`VariableBatch*` dists; docs/sharding.md, "Variable batch sizes"), no separate awaitable'
    ),
    "torchrec.distributed.grouped_position_weighted.GroupedPositionWeightedModule": (
        "position weights on sharded tables are done by `ShardedFeatureProcessedEmbeddingBagCollection` "
        "(`shardkit.sharding.fp_embeddingbag`), not by a grouped feature-processor module"
    ),
    "torchrec.distributed.types.GenericMeta": (
        "an undocumented metaclass (base `type`, no members in the specification); shardkit's generic "
        "classes use `typing.Generic`"
    ),
    "torchrec.distributed.types.scope": (
        "an undocumented helper behind `LazyAwaitable`'s operator methods; shardkit's `LazyAwaitable` "
        "generates them with its own helpers (`shardkit.distributed.awaitable`)"
    ),
    "torchrec.distributed.utils.convert_to_fbgemm_types": (
        "converts fused params into fbgemm's types; shardkit's kernels take shardkit's fused params "
        "(`OptimType`, ...) as they are, there are no fbgemm types to convert to"
    ),
    "ocpmodels.common.gp_utils._DATA_PARALLEL_GROUP": _GROUP_REASON,
    "ocpmodels.common.gp_utils._GRAPH_PARALLEL_GROUP": _GROUP_REASON,
    "nemo_rl.algorithms.loss.loss_functions": (
        "a module named only in a cross-reference of x_token.loss_utils' docstring; the specification "
        "documents none of its names"
    ),
}
ABSENT_CELL = "deliberately absent (see below)"


def spec_names(spec_dir: Path) -> list[str]:
    names: set[str] = set()
    for path in sorted(spec_dir.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        names.update(m.group(0).rstrip(".") for m in QUALIFIED.finditer(text))
    names |= EXTRA
    # a prefix of another name is a module, not an API name
    return sorted(n for n in names if not any(other.startswith(n + ".") for other in names))


def shardkit_definitions() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Leaf name -> modules that define an object of that name, and -> modules that only re-export one
    (aliases such as gp_utils' ``_split_tensor``), both for objects defined in shardkit; module-level
    data (distill's ``_SPARSE_PROJECTION_CACHE``) counts as re-exported wherever it is visible, after
    the objects."""
    defined: dict[str, list[str]] = {}
    exported: dict[str, list[str]] = {}
    values: dict[str, list[str]] = {}
    for info in pkgutil.walk_packages(shardkit.__path__, "shardkit."):
        module = importlib.import_module(info.name)
        for attr, obj in vars(module).items():
            home = getattr(obj, "__module__", None) or ""
            if attr.startswith("__"):
                continue
            if isinstance(obj, (dict, list, set, tuple, int, float, str)) and not isinstance(obj, type):
                # module-level data (a cache dict, a constant) has no __module__: listed where it is
                # visible, after the defined and re-exported objects
                values.setdefault(attr, []).append(info.name)
                continue
            if not home.startswith("shardkit"):
                continue
            if home == info.name and getattr(obj, "__name__", attr) == attr:
                defined.setdefault(attr, []).append(info.name)
            else:
                exported.setdefault(attr, []).append(info.name)
    for attr, homes in values.items():
        exported.setdefault(attr, homes)
    return defined, exported


def locate(name: str, defined: dict[str, list[str]], exported: dict[str, list[str]]) -> str:
    """Where shardkit has ``name`` (by its last component; ``Class.method`` by the class)."""
    parts = name.split(".")
    leaf = parts[-1]
    homes = defined.get(leaf) or exported.get(leaf)
    if homes:
        return ", ".join(f"`{home}.{leaf}`" for home in sorted(set(homes))[:3])
    owner = parts[-2]
    for home in defined.get(owner, []):
        if hasattr(getattr(importlib.import_module(home), owner), leaf):
            return f"`{home}.{owner}.{leaf}`"
    if name in DELIBERATELY_ABSENT:
        return ABSENT_CELL
    return "not in shardkit"


def main(spec_dir: str) -> None:
    defined, exported = shardkit_definitions()
    rows = [(name, locate(name, defined, exported)) for name in spec_names(Path(spec_dir))]
    missing = sum(1 for _, where in rows if where == "not in shardkit")
    absent = [name for name, where in rows if where == ABSENT_CELL]
    stale = sorted(set(DELIBERATELY_ABSENT) - set(absent))
    if stale:  # found in shardkit now, or no longer in the specification: the list must say so
        raise SystemExit(f"DELIBERATELY_ABSENT lists names that are not absent specification names: {stale}")
    print("# Every specification name and its shardkit location\n")
    print("Generated by `python tools/spec_names.py ../shared/spec`: each fully qualified name in the")
    print("specification documents, looked up by its last component among the objects shardkit's modules")
    print(f"define. {len(rows) - missing - len(absent)} of {len(rows)} names are found, {len(absent)} are")
    print(f"deliberately absent (the reasons are below the table) and {missing} are `not in shardkit`.")
    print("docs/names.md gives the mapping by module.\n")
    print("| specification name | shardkit |")
    print("|---|---|")
    for name, where in rows:
        print(f"| `{name}` | {where} |")
    print("\n## Deliberately absent\n")
    print("Names shardkit leaves out on purpose, grouped by the reason.\n")
    by_reason: dict[str, list[str]] = {}
    for name in absent:
        by_reason.setdefault(DELIBERATELY_ABSENT[name], []).append(name)
    for reason, names in by_reason.items():
        print(f"- {', '.join(f'`{n}`' for n in names)}: {reason}.")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/spec")
