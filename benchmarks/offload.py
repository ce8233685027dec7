"""Offloaded tables (``fused_uvm``, ``fused_uvm_caching``) against the same table in memory (``fused``).

Run from the repository root: ``python -m benchmarks.offload [--quick]``.

Every row is a training step (forward + fused row-wise Adagrad backward) of one table sharded by a plan
(world of one, no collectives), ids drawn from a Zipf law (exponent ``--zipf``, default 1.05; hot rows
spread over the table by a random permutation):

- ``fused`` in memory, then ``fused_uvm_caching`` at load factors 0.01 / 0.05 / 0.2 / 1.0 and
  ``fused_uvm``, each as steps/s and ``vs_fused`` (in-memory step time / offloaded step time, measured in
  this run: 1.0 = as fast as in memory), with the cache's hit rate (distinct rows of a step), its misses
  per id looked up and the MB it read / wrote per step, in two phases (``benchmarks/offload_steady.py``):
  ``(cold ...)``: the first ``--cold-steps`` steps of empty caches; ``(steady)``: after each cache was
  driven to its steady state (the cache calls of training steps, until full and its hit rate flat),
  ``--warmup`` training steps, then ``--steps`` timed ones. Steady rows carry the warming's batches,
  seconds and last hit rate, and ``predicted_id_miss_rate``: ``CacheStatistics.from_ids`` of
  ``--stats-steps`` steps of the same stream (compare with ``id_miss_rate``);
- variants of ``fused_uvm_caching`` at ``--mapped-load-factors`` (default 0.2): ``mapped``, its backing
  file kept mapped (``$SHARDKIT_OFFLOAD_RESIDENT_MAP``; ``mapped_MiB``: the file, which may all stay in
  RSS); and at ``--in-step-write-back-load-factors`` (default 0.2): ``in-step write-back``, without the
  write-behind thread (``SHARDKIT_OFFLOAD_WRITE_BEHIND=0``), the same step as the default rows but
  evicted rows written in the step; ``main_cpu_ms/step`` is the main thread's CPU alone
  (docs/offload/miss_path.md, "Write-behind and kept mappings"); and at
  ``--one-read-thread-load-factors`` (default 0.2): ``1 read thread``, a step's misses read on one
  thread (``SHARDKIT_OFFLOAD_READ_THREADS=1``) instead of the default two
  (docs/offload/miss_path.md, "Native bookkeeping and reader threads"); and at
  ``--lfu-load-factors`` (default 0.2): ``lfu``, the cache's replacement LFU instead of LRU (fewer
  misses on Zipf ids, docs/offload/costs.md);
- the same table trained through ``PrefetchTrainPipelineSparseDist``: in memory, and offloaded with
  ``prefetch_pipeline`` at ``--pipeline-load-factors`` (default 0.2), the prefetch of batch i+1 run
  synchronously and on the background thread (``benchmarks/offload_pipeline.py``);
- the backing file's read bandwidth: the cache's miss path (rows gathered from the mapped file, pages
  unmapped after) next to a sequential read and a random 4 KiB ``pread`` of the same file: the physical
  limits (page cache; the file was just written, so these measure memory, not the disk);
- a table ``--big-factor`` (default 10) times a memory budget, ``fused_uvm_caching`` with the cache
  within the budget, run in a fresh process, cold and steady as above: its steps/s next to the in-memory
  step of a table that fits the budget, and its peak resident set beyond the process's baseline over
  the whole run, and apart: the table's initialization and the steps after it (malloc thresholds at
  1 MiB, ``SHARDKIT_MALLOC_THRESHOLD``, named in the row; ``benchmarks/offload_budget.py``).

Goals (issue 24), on the steady rows: load factor 0.2 on Zipf ids >= 0.8x the in-memory step; a table
10x the budget >= 0.5x the in-memory step of a table that fits, its peak RSS within the budget.
Absolute times on a shared machine are noise; the ratios are measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

from benchmarks.common import write_results
from benchmarks.offload_budget import big_child, big_rows, budget_goal_line
from benchmarks.offload_pipeline import add_arguments as add_pipeline_arguments
from benchmarks.offload_pipeline import pipeline_rows
from benchmarks.offload_steady import add_arguments as add_steady_arguments
from benchmarks.offload_steady import predicted_miss_rates, warm_to_steady, zipf_sampler

LOAD_FACTORS = (0.01, 0.05, 0.2, 1.0)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sharded_table(
    kernel: str,
    rows: int,
    dim: int,
    load_factor: float,
    offload_dir: str,
    meta: bool,
    prefetch: bool = False,
    algorithm: str = "lru",
):
    """One table, sharded table-wise on a world of one with ``kernel`` (row-wise Adagrad, fused);
    ``prefetch``: its cache params set ``prefetch_pipeline`` (for PrefetchTrainPipelineSparseDist);
    ``algorithm``: the cache's replacement (``"lru"``, ``"lfu"``)."""
    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, OptimType
    from shardkit.sharding.cache_params import CacheParams
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan, table_wise

    fused = FusedOptimizerConfig(OptimType.ROWWISE_ADAGRAD, lr=0.01)
    config = EmbeddingBagConfig(rows, dim, name="t", feature_names=["f"])
    device = torch.device("meta" if meta else "cpu")
    ebc = EmbeddingBagCollection([config], device=device, fused_optimizer=fused)
    plan = construct_module_sharding_plan(ebc, {"t": table_wise(rank=0)}, 1, 1)
    if kernel != "fused":
        cache = CacheParams(
            load_factor=load_factor, algorithm=algorithm, offload_dir=offload_dir, prefetch_pipeline=prefetch
        )
        plan = {k: dataclasses.replace(v, compute_kernel=kernel, cache_params=cache) for k, v in plan.items()}
    return EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_local(1, 0))


# benchmark variants of an offloaded table: environment set while it is built
VARIANTS = {
    "": {},
    # its backing file kept mapped and resident (BackingStore.keep_mapped): rows move by copies through
    # the mapping instead of preadv / pwritev, the file's pages stay in RSS
    "mapped": {"SHARDKIT_OFFLOAD_RESIDENT_MAP": "1024G"},
    # evicted dirty rows written in the step, as before the write-behind thread
    "in-step write-back": {"SHARDKIT_OFFLOAD_WRITE_BEHIND": "0"},
    # a step's misses read on one thread, as before the reader threads (row_io.read_threads_default)
    "1 read thread": {"SHARDKIT_OFFLOAD_READ_THREADS": "1"},
    # the cache's replacement LFU instead of LRU (fewer misses on Zipf ids: docs/offload/costs.md)
    "lfu": {},
}


def _table_variant(kernel: str, rows: int, dim: int, load_factor: float, offload_dir: str, variant: str):
    """``sharded_table`` (on the meta device unless ``fused``), built with ``VARIANTS[variant]`` in
    the environment (only while it is built: the other tables are not affected)."""
    saved = {k: os.environ.get(k) for k in VARIANTS[variant]}
    os.environ.update(VARIANTS[variant])
    try:
        algorithm = "lfu" if variant == "lfu" else "lru"
        meta = kernel != "fused"
        module = sharded_table(kernel, rows, dim, load_factor, offload_dir, meta, algorithm=algorithm)
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    if variant == "mapped":
        assert offloaded_lookup(module).store.resident, "the mapped table did not keep its mapping"
    if variant == "in-step write-back":
        assert offloaded_lookup(module).cache._write_behind is None
    if variant == "1 read thread":
        assert offloaded_lookup(module).cache._row_io.read_threads == 1
    if variant == "lfu":
        assert offloaded_lookup(module).cache.algorithm == "lfu"
    return module


def batches(rows: int, args, count: int, stream: int = 0) -> List[Any]:
    """``count`` KJTs of ``args.batch`` bags of ``args.pooling`` Zipf ids (``stream``: see zipf_sampler)."""
    from shardkit.sparse import KeyedJaggedTensor

    sample = zipf_sampler(rows, args.zipf, args.seed, stream)
    lengths = torch.full((args.batch,), args.pooling)
    return [
        KeyedJaggedTensor(["f"], sample(args.batch * args.pooling), lengths=lengths) for _ in range(count)
    ]


def step(module, kjt) -> None:
    """One training step: forward, loss, backward (the fused optimizer updates the rows), and then the
    end of the evicted rows' background writes (write-behind, kernels/offload/write_behind.py): they
    overlap this step only, never the next module's step of a round (the step time is the conservative
    one: in training they could overlap the next step of the same model too)."""
    module(kjt).wait().values().sum().backward()
    for lookup in getattr(module, "lookups", ()):
        for group in getattr(lookup, "lookups", ()):
            writer = getattr(getattr(group, "cache", None), "_write_behind", None)
            if writer is not None:
                writer.wait()


def offloaded_lookup(module):
    """The module's one offloaded lookup (one table, table-wise, world of one)."""
    return module.lookups[0].lookups[0]


def warm(module, rows: int, args) -> Dict[str, Any]:
    """Bring an offloaded table's cache to its steady state (``offload_steady.warm_to_steady``: the
    cache driven with a training step's acquire / dirty release, ids of the steps' distribution and hot
    rows, stream 1), then zero its counters; what the warming took."""
    lookup = offloaded_lookup(module)
    sample = zipf_sampler(rows, args.zipf, args.seed, stream=1)
    done = warm_to_steady(lookup.cache, sample, args.batch * args.pooling, args)
    lookup.reset_cache_stats()
    return done


def _rounds(modules, inputs, times, cpu_times, main_cpu_times=None) -> None:
    """One step of each module per batch, in turn (a change of the machine's load hits them alike);
    ``main_cpu_times``: also the CPU time of this (the main) thread alone."""
    main_cpu_times = main_cpu_times or [[] for _ in modules]
    for kjt in inputs:
        for module, spent, cpu_spent, main_spent in zip(modules, times, cpu_times, main_cpu_times):
            start, cpu_start, main_start = time.perf_counter(), time.process_time(), time.thread_time()
            step(module, kjt)
            spent.append(time.perf_counter() - start)
            cpu_spent.append(time.process_time() - cpu_start)
            main_spent.append(time.thread_time() - main_start)


def _median(values: List[float]) -> float:
    return sorted(values)[len(values) // 2]


def _phase_row(name, rows, seconds, cpu, fused_s, fused_cpu, stats, ids) -> Dict[str, Any]:
    row: Dict[str, Any] = {"name": name, "rows": rows, "steps/s": 1.0 / seconds, "ms/step": seconds * 1e3}
    row["vs_fused"] = fused_s / seconds
    # CPU time of the process (all threads): on a shared, loaded machine the steadier measure
    row["cpu_ms/step"] = cpu * 1e3
    row["cpu_vs_fused"] = fused_cpu / cpu if cpu > 0 else float("nan")
    if stats is not None:
        calls = max(stats["calls"], 1)
        row["hit_rate"] = float(stats["hit_rate"])  # of the distinct rows of each step
        row["id_miss_rate"] = stats["misses"] / ids if ids else float("nan")  # per id looked up
        row["MB_read/step"] = stats["bytes_read"] / calls / 1e6
        row["MB_written/step"] = stats["bytes_written"] / calls / 1e6
    return row


def step_rows(args, offload_dir: str) -> List[Dict[str, Any]]:
    """fused in memory, fused_uvm_caching at each load factor, fused_uvm: the cold phase (the first
    ``--cold-steps`` steps of empty caches) and the steady state (after ``warm``), steps/s and ratios,
    with CacheStatistics' predicted miss rates next to the measured ones.

    The modules step in turn (one step each per round, the same batches in the same order); each one's
    time is its median over the rounds.
    """
    configs = [("fused", 1.0, "")] + [("fused_uvm_caching", lf, "") for lf in args.load_factors]
    configs.append(("fused_uvm", 1.0, ""))
    configs += [("fused_uvm_caching", lf, "mapped") for lf in args.mapped_load_factors]
    configs += [
        ("fused_uvm_caching", lf, "in-step write-back") for lf in args.in_step_write_back_load_factors
    ]
    configs += [("fused_uvm_caching", lf, "1 read thread") for lf in args.one_read_thread_load_factors]
    configs += [("fused_uvm_caching", lf, "lfu") for lf in args.lfu_load_factors]
    modules = [
        _table_variant(kernel, args.rows, args.dim, lf, offload_dir, variant)
        for kernel, lf, variant in configs
    ]
    ids_per_step = args.batch * args.pooling
    rows: List[Dict[str, Any]] = []
    phases: Dict[str, List[Dict[str, Any]]] = {"cold": [], "steady": []}
    # the cold phase: empty caches, stream 0 (fused warms its kernels with one step first)
    step(modules[0], batches(args.rows, args, 1, stream=3)[0])
    for phase in ("cold", "steady"):
        if phase == "steady":
            warmed = {}
            for module, (kernel, lf, variant) in zip(modules, configs):
                if kernel == "fused_uvm_caching":
                    warmed[lf, variant] = warm(module, args.rows, args)
                    print(f"warmed lf={lf} {variant}: {warmed[lf, variant]}", flush=True)
            settle = [[] for _ in modules], [[] for _ in modules]
            _rounds(modules, batches(args.rows, args, args.warmup, stream=2), *settle)
        for module, (kernel, _, _) in zip(modules, configs):
            if kernel != "fused":  # counters of this phase's timed steps only
                offloaded_lookup(module).reset_cache_stats()
        count = args.cold_steps if phase == "cold" else args.steps
        inputs = batches(args.rows, args, count, stream=0 if phase == "cold" else 4)
        times: List[List[float]] = [[] for _ in modules]
        cpu_times: List[List[float]] = [[] for _ in modules]
        main_cpu_times: List[List[float]] = [[] for _ in modules]
        _rounds(modules, inputs, times, cpu_times, main_cpu_times)
        medians = [_median(t) for t in times]
        cpu_medians = [_median(t) for t in cpu_times]
        main_cpu_medians = [_median(t) for t in main_cpu_times]
        for (kernel, lf, variant), module, seconds, cpu, main_cpu in zip(
            configs, modules, medians, cpu_medians, main_cpu_medians
        ):
            name = kernel if kernel != "fused_uvm_caching" else f"{kernel} lf={lf}"
            name += f" {variant}" if variant else ""
            name += f" ({phase}{f': first {count} steps' if phase == 'cold' else ''})"
            stats = None if kernel == "fused" else module.cache_stats()["t"]
            row = _phase_row(
                name, args.rows, seconds, cpu, medians[0], cpu_medians[0], stats, count * ids_per_step
            )
            # the main thread's CPU alone: without the write-behind thread's (the critical path when a
            # core is free for that thread)
            row["main_cpu_ms/step"] = main_cpu * 1e3
            if variant == "mapped":  # the backing file kept mapped: up to all of it resident (RssFile)
                row["mapped_MiB"] = offloaded_lookup(module).store.nbytes / 2**20
            if phase == "steady" and kernel == "fused_uvm_caching":
                row.update(warmed[lf, variant])
            phases[phase].append(row)
    predicted = predicted_miss_rates(
        zipf_sampler(args.rows, args.zipf, args.seed, stream=5),
        args.rows,
        ids_per_step,
        args.stats_steps,
        sorted({lf for k, lf, _ in configs if k == "fused_uvm_caching"}),
    )
    for row, (kernel, lf, _) in zip(phases["steady"], configs):
        if kernel == "fused_uvm_caching":
            row["predicted_id_miss_rate"] = predicted["miss"][lf]
            row["stats_informed_rows"] = predicted["informed_rows"]
    print(
        f"CacheStatistics from {args.stats_steps} steps ({predicted['sample_ids']} ids, "
        f"{predicted['informed_rows']} distinct) in {predicted['seconds']:.1f} s",
        flush=True,
    )
    rows += phases["steady"] + phases["cold"]
    return rows


def bandwidth_rows(args, offload_dir: str) -> List[Dict[str, Any]]:
    """The cache's gather of random rows from the backing file vs sequential / random reads of it."""
    from shardkit.kernels.offload.backing_store import BackingStore

    store = BackingStore.create({"weight": ((args.rows, args.dim), torch.float32)}, {"bench": 1}, offload_dir)
    weight = store.tensors["weight"]
    chunk = max(1, (16 << 20) // (args.dim * 4))
    for start in range(0, args.rows, chunk):
        weight[start : start + chunk].uniform_()
        store.drop_resident()
    store.flush()
    row_bytes = args.dim * 4
    gen = torch.Generator().manual_seed(args.seed)
    count = min(args.rows, 65536)
    rows = torch.randint(0, args.rows, (count,), generator=gen).sort().values  # the cache reads ascending
    out = []

    def gather() -> None:
        for start in range(0, count, 256):  # as the cache's miss path: 256 rows a chunk, pages dropped
            weight.index_select(0, rows[start : start + 256])
            store.drop_resident()

    seconds = _best(gather, args.repeats)
    out.append(_bw_row("file: old miss path (mmap gather, 256-row chunks)", count * row_bytes, seconds))
    row_io = store.row_io()
    distinct = torch.unique(rows)  # the cache reads distinct rows

    def positioned() -> None:
        row_io.read_fields(distinct)

    seconds = _best(positioned, args.repeats)
    out.append(_bw_row("file: pure-Python miss path (os.preadv)", distinct.numel() * row_bytes, seconds))
    into = {"weight": torch.empty(distinct.numel(), args.dim)}
    slots = torch.arange(distinct.numel())
    if row_io._native(into, "auto") is not None:

        def native() -> None:
            row_io.read_into(distinct, into, slots)

        seconds = _best(native, args.repeats)
        out.append(_bw_row("file: cache miss path (native read_into)", distinct.numel() * row_bytes, seconds))
    size = os.path.getsize(store.path)
    fd = os.open(store.path, os.O_RDONLY)
    try:

        def sequential() -> None:
            offset = 0
            while offset < size:
                offset += len(os.pread(fd, 16 << 20, offset))

        seconds = _best(sequential, args.repeats)
        out.append(_bw_row("file: sequential read (16 MiB preads)", size, seconds))
        picks = random.Random(args.seed)
        offsets = [picks.randrange(0, size // 4096) * 4096 for _ in range(count)]

        def random_reads() -> None:
            for offset in offsets:
                os.pread(fd, 4096, offset)

        seconds = _best(random_reads, args.repeats)
        out.append(_bw_row("file: random 4 KiB preads", count * 4096, seconds))
    finally:
        os.close(fd)
        store.close()
    return out


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _bw_row(name: str, num_bytes: int, seconds: float) -> Dict[str, Any]:
    return {"name": name, "MB": num_bytes / 1e6, "ms": seconds * 1e3, "GB/s": num_bytes / seconds / 1e9}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="table rows of the step comparison")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048, help="bags per step")
    parser.add_argument("--pooling", type=int, default=16, help="ids per bag")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    parser.add_argument("--load-factors", type=float, nargs="+", default=list(LOAD_FACTORS))
    parser.add_argument(
        "--mapped-load-factors",
        type=float,
        nargs="*",
        default=[0.2],
        help="load factors also run with the backing file kept mapped (rows named 'mapped'; none: skip)",
    )
    parser.add_argument(
        "--in-step-write-back-load-factors",
        type=float,
        nargs="*",
        default=[0.2],
        help="load factors also run without the write-behind thread (rows 'in-step write-back'; none: skip)",
    )
    parser.add_argument(
        "--one-read-thread-load-factors",
        type=float,
        nargs="*",
        default=[0.2],
        help="load factors also run with misses read on one thread (rows '1 read thread'; none: skip)",
    )
    parser.add_argument(
        "--lfu-load-factors",
        type=float,
        nargs="*",
        default=[0.2],
        help="load factors also run with LFU replacement instead of LRU (rows named 'lfu'; none: skip)",
    )
    parser.add_argument("--steps", type=int, default=10, help="measured steps (median)")
    parser.add_argument(
        "--warmup", type=int, default=5, help="training steps after warming, before measuring"
    )
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each bandwidth measurement")
    parser.add_argument("--budget-mb", type=float, default=64.0, help="memory budget of the big-table run")
    parser.add_argument("--big-factor", type=float, default=10.0, help="big table / budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offload-dir", default=None, help="where backing files go (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="small sizes: runs in seconds")
    parser.add_argument("--out", default=None, help="directory for offload.json")
    parser.add_argument("--child-big", action="store_true", help=argparse.SUPPRESS)
    add_pipeline_arguments(parser)
    add_steady_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.pooling = 50_000, 128, 8
        args.steps, args.warmup, args.repeats, args.budget_mb = 2, 1, 1, 4.0
        args.cold_steps, args.warm_window, args.warm_cap, args.stats_steps = 2, 4, 256, 64
        args.pipeline_steps, args.pipeline_block = 4, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_big:
        big_child(args)
        return
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-offload-", dir=args.offload_dir) as offload_dir:
        rows = step_rows(args, offload_dir)
        if args.pipeline_load_factors:
            rows += pipeline_rows(args, offload_dir)
        rows += bandwidth_rows(args, offload_dir)
        rows += big_rows(args, offload_dir)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "child_big", "offload_dir")}
    config.update(cpu_model=cpu_model(), load_average=list(os.getloadavg()))
    write_results("offload", config, rows, args.out)
    goals = {r["name"]: r["vs_fused"] for r in rows if "vs_fused" in r}
    lf02 = goals.get("fused_uvm_caching lf=0.2 (steady)")
    mapped02 = goals.get("fused_uvm_caching lf=0.2 mapped (steady)")
    big = [v for k, v in goals.items() if "x the budget" in k and k.endswith("(steady)")]
    if lf02 is not None:
        print(
            f"goal: load factor 0.2 >= 0.8x in memory (steady state): {lf02:.2f}x "
            f"{'met' if lf02 >= 0.8 else 'NOT met'}"
        )
    if mapped02 is not None:
        print(
            f"goal, backing file kept mapped ($SHARDKIT_OFFLOAD_RESIDENT_MAP; its pages count in RSS): "
            f"load factor 0.2 >= 0.8x in memory: {mapped02:.2f}x {'met' if mapped02 >= 0.8 else 'NOT met'}"
        )
    lfu02 = goals.get("fused_uvm_caching lf=0.2 lfu (steady)")
    if lfu02 is not None:
        print(f"load factor 0.2 with LFU instead of LRU (steady state): {lfu02:.2f}x in memory")
    piped = goals.get("pipeline fused_uvm_caching lf=0.2 prefetch async")
    if piped is not None:
        print(
            f"goal, through PrefetchTrainPipelineSparseDist (async prefetch): load factor 0.2 >= 0.8x "
            f"in memory: {piped:.2f}x {'met' if piped >= 0.8 else 'NOT met'}"
        )
    if big:
        print(
            f"goal: {args.big_factor:g}x-budget table >= 0.5x in memory (steady state): {big[0]:.2f}x "
            f"{'met' if big[0] >= 0.5 else 'NOT met'}"
        )
    budget_line = budget_goal_line(rows, args.quick)
    if budget_line is not None:
        print(budget_line)


if __name__ == "__main__":
    main()
