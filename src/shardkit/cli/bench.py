"""``shardkit bench NAME...|all``: run benchmark scripts, print their tables, write JSON and PNG charts.

A benchmark is ``benchmarks/<name>.py`` of a shardkit checkout (``--dir`` to point elsewhere) with a
``main(argv)`` accepting ``--out DIR``, writing ``<DIR>/<name>.json`` in the shape of
``benchmarks/common.py``; without ``--out``, DIR is a new directory outside the source tree
(:func:`default_out_dir`). Each runs in its own Python process (``python -m benchmarks.<name>``), so one
benchmark's thread settings or worker processes cannot skew the next. With matplotlib installed (the
``plot`` extra) each JSON also gets a bar chart next to it, one panel per measured (float) metric.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

# Sizes that run each benchmark in seconds: for checking that it works, not for its figures.
QUICK_ARGS: Dict[str, List[str]] = {
    "kjt_ops": ["--keys", "4", "--batch", "64", "--large-batch", "256", "--repeats", "1"],
    "embedding_lookup": [
        *("--batch", "64", "--pooling", "4", "--dim", "16", "--sizes", "1000", "--tables", "2"),
        *("--table-rows", "1000", "--small-tables", "4", "--small-batch", "16", "--repeats", "1"),
    ],
    "planner": ["--tables", "10", "--ranks", "8", "--repeats", "1"],
    "fused_backward_shapes": ["--shapes", "row32", "--repeats", "1"],
    "plan_quality": ["--quick", "--sets", "demo", "--worlds", "2", "--rounds", "1", "--steps", "1"],
    "plan_groups": ["--rounds", "1", "--steps", "1"],
    "lookup_groups": ["--quick", "--rounds", "1", "--steps", "1"],
    "vocab_parallel_ce": [
        *("--tokens", "64", "--vocab", "512", "--hidden", "16", "--dtype", "fp32", "--repeats", "1"),
        *("--device", "cpu"),
    ],
    "fused_linear_ce": [
        *("--tokens", "64", "--vocab", "512", "--hidden", "16", "--rounds", "1", "--device", "cpu"),
    ],
    "sharded_ebc": [
        *("--tables", "2", "--rows", "1000", "--dim", "8", "--batch", "32", "--pooling", "2"),
        *("--repeats", "1", "--types", "table_wise", "row_wise"),
    ],
    "gpu": [
        *("--rows", "10000", "--dim", "16", "--batch", "256", "--pooling", "4", "--repeats", "1"),
        *("--copy-mib", "8", "--ce-tokens", "64", "--ce-vocab", "512"),
    ],
    "gpu_tiles": [
        *("--rows", "10000", "--dim", "16", "--batch", "256", "--pooling", "4", "--repeats", "1"),
        *("--copy-mib", "8"),
    ],
    "gpu_losses": [
        *("--tokens", "64", "--vocab", "512", "--hidden", "16", "--dtypes", "fp32", "--repeats", "1"),
    ],
    "step_counts": [
        *("--tables", "2", "--rows", "1000", "--dim", "8", "--batch", "32", "--pooling", "2"),
        *("--steps", "1", "--types", "table_wise", "row_wise"),
    ],
    "vs_torchrec": [
        *("--tables", "2", "--rows", "1000", "--dim", "8", "--batch", "32", "--pooling", "2"),
        *("--iters", "2", "--warmup", "1", "--rounds", "1", "--types", "table_wise"),
    ],
    # the sweep's 9-row subset: real figures, under 3 minutes on the idle 2-core machine
    "vs_torchrec_sweep": ["--quick"],
    "managed_collision": [
        *("--slots", "1000", "--batch", "10000", "--rows", "1000", "--dim", "8"),
        *("--step-batch", "64", "--pooling", "2", "--repeats", "1"),
    ],
    "quant_lookup": ["--rows", "1000", "--dim", "16", "--batch", "64", "--pooling", "4", "--repeats", "1"],
    "offload": ["--quick"],
    "offload_row_io": ["--quick"],
    "offload_slot_map": ["--quick"],
    "column_placement": ["--rows", "32", "2048", "--rounds", "1"],
    "fresh_pages": ["--mib", "8", "--calls", "1", "--rounds", "1"],
    "ec_dedup": ["--batch", "64"],
    "serving": ["--tables", "2", "--max-rows", "100", "--batch-sizes", "1", "4", "--repeats", "3"],
    "step_overhead": [
        *("--tables", "4", "--rows", "100", "1000", "--dim", "8", "--batch", "8"),
        *("--steps", "3", "--warmup", "1", "--profile-steps", "2", "--rounds", "1"),
    ],
    "pipeline": [
        *("--tables", "2", "--rows", "1000", "--dim", "8", "--batch", "32", "--pooling", "2"),
        *("--steps", "3", "--warmup", "1", "--repeats", "1"),
    ],
    # its megatron method runs only where megatron-core imports (the peer venv): skipped elsewhere
    "ce_backward_ab": ["--tokens", "64", "--width", "512", "--rounds", "1"],
    "ce_block_sweep": ["--tokens", "16", "--width", "4096", "--repeats", "1"],
    # its megatron rows run only where megatron-core imports (the peer venv)
    "ce_cache_sensitivity": [
        *("--tokens", "16", "--vocab", "4096", "--rounds", "1", "--caches", "32K/512K,48K/2M"),
    ],
    "offload_miss_path": ["--quick"],
    "offload_miss_locality": ["--quick"],
    "prefetch_distance": [*("--dims", "16", "--distances", "0", "16", "--table-mib", "8"), "--rounds", "1"],
    # on a CUDA machine its real rows; elsewhere the same rows on the CPU (a check that it runs)
    "offload_gpu": ["--quick"],
    # without CUDA: the device bookkeeping's ops and host-value calls counted on CPU tensors
    "offload_gpu_syncs": ["--quick", "--device", "cpu"],
    "step_phases": ["--steps", "3", "--warmup", "1"],
    "shm_transport": ["--quick"],
    # needs torchrec (the peer venv); elsewhere it writes a "skipped" result saying what to install
    "step_waits": ["--rows", "1", "--steps", "1", "--rounds", "1"],
    "step_profile": ["--rows", "1", "--steps", "1", "--rounds", "1"],  # needs torchrec, as step_waits
}
# not benchmarks of their own: shared helpers, the pipeline rows and the budget run of offload.py
# (offload_budget: its --child-big process), the steady-state cache
# warming offload.py imports (offload_steady: no main, no table of its own), and a wrapper of a peer
# script that runs only in the Megatron peer venv (../shared/peers; docs/performance.md has its command)
_NOT_BENCHMARKS = {
    *("__init__", "common", "offload_budget", "offload_pipeline", "offload_steady", "round_noise"),
    "vs_megatron_ce_dtype",
    "prefetch_vs_fbgemm",  # needs fbgemm: runs only in the torchrec peer venv (docs/performance.md)
    "sweep_kernel_vs_fbgemm",  # needs fbgemm: runs only in the torchrec peer venv (docs/performance.md)
    "plan_refit",  # times nothing: refits recorded plan_quality runs (docs/planner/plan_quality.md)
}


def default_dir() -> Path:
    """``./benchmarks`` when run from a checkout's root, else the checkout this shardkit comes from."""
    here = Path.cwd() / "benchmarks"
    if (here / "common.py").is_file():
        return here
    return Path(__file__).resolve().parents[3] / "benchmarks"


def default_out_dir() -> Path:
    """Where results go without ``--out``: a new directory outside the source tree, so that a run never
    replaces the figures committed in ``benchmarks/results/`` (a CPU run of the GPU benchmark used
    to overwrite them with an empty result).

    ``$SHARDKIT_BENCH_OUT`` if set, else ``$XDG_CACHE_HOME/shardkit/bench/<UTC date-time>``
    (``~/.cache`` without ``XDG_CACHE_HOME``), with ``-2``, ``-3`` ... appended if that exists.
    """
    chosen = os.environ.get("SHARDKIT_BENCH_OUT")
    if chosen:
        return Path(chosen)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    base = cache / "shardkit" / "bench" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def available(bench_dir: Path) -> List[str]:
    """Names of the benchmark scripts in ``bench_dir``, sorted."""
    return sorted(p.stem for p in bench_dir.glob("*.py") if p.stem not in _NOT_BENCHMARKS)


def run_one(name: str, bench_dir: Path, out_dir: Path, quick: bool) -> Optional[Path]:
    """Run one benchmark (its output goes to this process's stdout); its JSON path, or None on failure."""
    cmd = [sys.executable, "-m", f"{bench_dir.name}.{name}", "--out", str(out_dir.resolve())]
    if quick:
        cmd += QUICK_ARGS[name]
    print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
    # worker processes a benchmark starts unpickle functions from benchmarks.<name>: they need its root too
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(bench_dir.parent), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(cmd, cwd=bench_dir.parent, env=env)  # inherits stdout: tables print as they come
    path = out_dir / f"{name}.json"
    if done.returncode != 0 or not path.is_file():
        print(f"== {name}: FAILED (exit code {done.returncode})", flush=True)
        return None
    return path


def chart(json_path: Path) -> Path:
    """A PNG next to the JSON: one horizontal bar panel per measured metric, one bar per row."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    data = json.loads(json_path.read_text())
    rows = data["rows"]
    # integer columns are sizes and counts (the configuration of a row); measurements are floats
    metrics: List[str] = []
    for row in rows:
        metrics += [k for k, v in row.items() if isinstance(v, float) and k not in metrics]
    cols = min(3, max(1, len(metrics)))
    nrows = max(1, -(-len(metrics) // cols))
    height = 0.3 * len(rows) + 1.2
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, height * nrows), squeeze=False)
    for ax in axes.flat[len(metrics) :]:
        ax.axis("off")
    # rows of one name at several sizes would share one bar: number the repeats
    labels, seen = [], {}
    for row in rows:
        name = str(row["name"])
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    for ax, metric in zip(axes.flat, metrics):
        shown = [
            (label, r[metric]) for label, r in zip(labels, rows) if isinstance(r.get(metric), (int, float))
        ]
        ax.barh([label for label, _ in shown], [value for _, value in shown])
        ax.set_title(metric, fontsize=9)
        ax.invert_yaxis()  # rows top to bottom in table order
        ax.tick_params(labelsize=7)
    fig.suptitle(data["benchmark"])
    fig.tight_layout()
    png = json_path.with_suffix(".png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def run(args) -> int:
    bench_dir = Path(args.dir) if args.dir else default_dir()
    names = available(bench_dir) if bench_dir.is_dir() else []
    if not names:
        print(
            f"shardkit bench: error: no benchmark scripts in {bench_dir} "
            "(run from a shardkit checkout or give --dir)",
            file=sys.stderr,
        )
        return 2
    if args.list:
        print("\n".join(names))
        return 0
    wanted = names if args.names == ["all"] else args.names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(
            f"shardkit bench: error: unknown benchmark {unknown[0]!r}; known: {', '.join(names)}, all",
            file=sys.stderr,
        )
        return 2
    no_quick = [n for n in wanted if args.quick and n not in QUICK_ARGS]
    if no_quick:
        print(
            f"shardkit bench: error: no --quick sizes for {', '.join(no_quick)} "
            f"(add them to QUICK_ARGS in {__file__})",
            file=sys.stderr,
        )
        return 2
    out_dir = Path(args.out) if args.out else default_out_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        print(f"shardkit bench: error: --out {out_dir} exists and is not a directory", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"shardkit bench: error: cannot create --out {out_dir}: {err.strerror}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401

        plotting = True
    except ImportError:
        plotting = False
        print("matplotlib is not installed: writing JSON only (pip install 'shardkit[plot]' for charts)")
    print(f"results go to {out_dir}", flush=True)
    failed = []
    for name in wanted:
        path = run_one(name, bench_dir, out_dir, args.quick)
        if path is None:
            failed.append(name)
        elif plotting:
            print(f"wrote {chart(path)}")
    if failed:
        print(f"shardkit bench: {len(failed)} of {len(wanted)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="run benchmarks: print tables, write JSON and PNG charts")
    parser.add_argument(
        "names", nargs="*", default=["all"], metavar="NAME", help="benchmark names, or all (default)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes: checks that they run, figures are meaningless"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="directory for JSON and PNG (default: $SHARDKIT_BENCH_OUT, else a new directory under "
        "~/.cache/shardkit/bench/; never the committed benchmarks/results/ unless named here)",
    )
    parser.add_argument(
        "--dir", default=None, help="directory of the benchmark scripts (default ./benchmarks)"
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.set_defaults(run=run)
