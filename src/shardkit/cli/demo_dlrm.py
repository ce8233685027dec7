"""``shardkit demo`` (``--model dlrm``, the default): plan, shard and train a DLRM, then prove it exact.

The parent process builds the model, plans its sharding (the planner, or one forced sharding type for
every table) and prints the plan. The ranks (``shardkit.testing.run_world``: local processes, gloo or
NCCL) each wrap a copy of the same initial model in ``DistributedModelParallel`` and train it with
``TrainPipelineSparseDist`` on their own synthetic batches; rank 0 draws a progress bar. The parent
then trains an unsharded copy on the global batches (every rank's samples of a step together) and
compares losses, dense weights and every table shard with it.

By default one more feature, ``user_id``, carries raw 64-bit ids (a million distinct ones, Zipf
distributed) into a table of ``--mc-slots`` rows through a ManagedCollisionEmbeddingBagCollection: its
map is cut into ``nproc`` buckets, so the sharded model (whatever sharding its table gets) equals the
unsharded one, and the check also compares the slot maps.

With ``--offload`` the largest table that is not data-parallel is offloaded: ``fused_uvm_caching``, its
rows and optimizer state in a backing file per shard, a cache of ``OFFLOAD_LOAD_FACTOR`` of its rows in
RAM (the table's memory budget). The demo prints the cache's hit rate and the bytes it moved, and the
same exactness check must pass: the offloaded table trains bitwise like an in-memory one.

With ``--checkpoint DIR`` the ranks save the trained model and optimizers with ``shardkit.checkpoint``;
then a fresh model is restored from it on another number of ranks (another plan) and its tables and
dense weights are compared with the saved ones, which must be equal exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from shardkit.cli.textplot import ProgressBar, curve
from shardkit.datasets import RawIdClicks, TableSpec
from shardkit.models import MixedDimDLRM, dense_parameters

PROG_NAME = "shardkit demo"
DENSE_IN = 13  # as in Criteo
DENSE_OUT = 16
LR = 0.5  # one SGD rate for tables and dense layers: a replicated table trains like a sharded one
# Smooth, so that the check compares like with like: sharded and unsharded float32 sums differ in their
# last bits, and through a ReLU a pre-activation that close to zero switches one sample's gradient on in
# one run and off in the other (a jump of 1e-4 in one step, not drift; MixedDimDLRM's docstring)
ACTIVATION = torch.nn.SiLU
# (rows, dim, mean ids per bag), cycled: big and small tables, narrow (interacting) and wide ones
TABLE_SHAPES = [
    (100_000, 16, 1.0),
    (2_000, 16, 3.0),
    (20_000, 32, 1.0),
    (50, 16, 1.0),
    (10_000, 16, 2.0),
    (500, 64, 4.0),
    (50_000, 16, 1.0),
    (5_000, 32, 2.0),
]


def demo_tables(count: int, max_rows: Optional[int] = None) -> List[TableSpec]:
    """``count`` tables of mixed sizes (rows capped at ``max_rows``)."""
    specs = []
    for i in range(count):
        rows, dim, pooling = TABLE_SHAPES[i % len(TABLE_SHAPES)]
        specs.append(TableSpec(f"t{i}", min(rows, max_rows or rows), dim, pooling))
    return specs


# share of the offloaded table's rows its cache keeps in RAM (--offload)
OFFLOAD_LOAD_FACTOR = 0.05
OFFLOAD_KERNEL = "fused_uvm_caching"

MC_FEATURE = "user_id"
MC_CARDINALITY = 1_000_000  # distinct raw ids of the managed-collision feature


def mc_tables(slots: int, nproc: int) -> List[TableSpec]:
    """The managed-collision table (``slots`` rounded up to whole buckets of ``nproc``), or none."""
    if slots <= 0:
        return []
    return [TableSpec(MC_FEATURE, -(-slots // nproc) * nproc, DENSE_OUT, 1.0)]


def data_source(tables, mc, batch_size: int, seed: int) -> RawIdClicks:
    """The demo's batches: one feature per table, and the raw-id feature (a million distinct ids)."""
    raw = [TableSpec(t.name, MC_CARDINALITY, t.dim, t.pooling) for t in mc]
    return RawIdClicks([*tables, *raw], batch_size, DENSE_IN, seed, [t.name for t in raw])


def make_model(
    tables: Sequence[TableSpec], seed: int, device: Optional[torch.device] = None, mc=(), nproc: int = 1
) -> MixedDimDLRM:
    torch.manual_seed(seed)
    return MixedDimDLRM(
        tables,
        DENSE_IN,
        DENSE_OUT,
        lr=LR,
        device=device,
        mc_tables=mc,
        mc_buckets=nproc,
        activation=ACTIVATION,
    )


def plan_sharding(model: MixedDimDLRM, tables: Sequence[TableSpec], args, mc=()) -> tuple:
    """``(ShardingPlan, printable table)``: the planner's plan and report, or the forced type's plan."""
    from shardkit.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from shardkit.sharding import sharding_plan as sp
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.sharding.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from shardkit.sharding.types import ShardingPlan

    world = args.nproc
    if args.sharding_type is None:
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device=args.device),
            batch_size=args.batch_size,
            constraints={t.name: ParameterConstraints(pooling_factors=[t.pooling]) for t in [*tables, *mc]},
        )
        plan = planner.plan(
            model, [EmbeddingBagCollectionSharder(), ManagedCollisionEmbeddingBagCollectionSharder()]
        )
        return plan, str(planner.last_report)
    make = {
        "data_parallel": lambda i: sp.data_parallel(),
        "table_wise": lambda i: sp.table_wise(rank=i % world),
        "row_wise": lambda i: sp.row_wise(),
        "column_wise": lambda i: sp.column_wise(ranks=[(i + k) % world for k in range(min(world, 2))]),
        "table_row_wise": lambda i: sp.table_row_wise(host_index=0),
        "table_column_wise": lambda i: sp.table_column_wise(host_index=0),
    }[args.sharding_type]
    module_plan = sp.construct_module_sharding_plan(
        model.ebc, {t.name: make(i) for i, t in enumerate(tables)}, world, world, args.device
    )
    plans = {"ebc": module_plan}
    if mc:
        # a managed-collision table can be row-, table- or column-wise; row-wise for the other types
        mc_type = args.sharding_type if args.sharding_type in ("table_wise", "column_wise") else "row_wise"
        mc_make = {
            "table_wise": lambda i: sp.table_wise(rank=0),
            "column_wise": make,
            "row_wise": lambda i: sp.row_wise(),
        }
        plans["mc_ebc"] = sp.construct_module_sharding_plan(
            model.mc_ebc, {t.name: mc_make[mc_type](i) for i, t in enumerate(mc)}, world, world, args.device
        )
        module_plan = {**module_plan, **plans["mc_ebc"]}
        tables = [*tables, *mc]
    rows = [("table", "shape", "sharding", "kernel", "ranks", "shards [rows,cols]")]
    for t in tables:
        ps = module_plan[t.name]
        shards = ps.sharding_spec.shards if ps.sharding_spec is not None else []
        rows.append(
            (
                t.name,
                f"{t.rows}x{t.dim}",
                ps.sharding_type,
                ps.compute_kernel,
                ",".join(str(s.rank) for s in shards) or "all",
                " ".join(f"[{s.shard_sizes[0]},{s.shard_sizes[1]}]" for s in shards) or "replicated",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    return ShardingPlan(plans), f"forced plan: every table {args.sharding_type}\n{text}"


def offload_largest(plan, tables: Sequence[TableSpec], load_factor: float = OFFLOAD_LOAD_FACTOR):
    """Switch the largest table of ``plan``'s ``ebc`` that is not data-parallel to ``fused_uvm_caching``
    (in place); that table, or None when every table is data-parallel (which cannot be offloaded)."""
    module_plan = plan.plan["ebc"]
    candidates = [t for t in tables if module_plan[t.name].sharding_type != "data_parallel"]
    if not candidates:
        return None
    table = max(candidates, key=lambda t: (t.rows * t.dim, t.rows))
    from shardkit.sharding.cache_params import CacheParams

    cache = CacheParams(load_factor=load_factor, algorithm="lru")
    module_plan[table.name] = dataclasses.replace(
        module_plan[table.name], compute_kernel=OFFLOAD_KERNEL, cache_params=cache
    )
    return table


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KiB"


def offload_header(table: TableSpec, load_factor: float = OFFLOAD_LOAD_FACTOR) -> str:
    """What ``--offload`` does to ``table``: where its rows live and the RAM its cache may use."""
    row_bytes = table.dim * 4  # fp32 weights (the demo's fused SGD keeps no state)
    cache_rows = max(1, round(load_factor * table.rows))
    return (
        f"offloaded: table {table.name} ({table.rows:,}x{table.dim}, {_size(table.rows * row_bytes)}) -> "
        f"{OFFLOAD_KERNEL}: its rows in a backing file per shard, a cache of {load_factor:g} of them in "
        f"RAM (memory budget ~{_size(cache_rows * row_bytes)} over the shards)"
    )


def offload_summary(ranks: List[dict], seconds: float) -> List[str]:
    """The offloaded table's cache counters over every rank: hit rate, rows and bytes moved."""
    from shardkit.modules.offloaded_lookup import sum_cache_stats

    stats = sum_cache_stats([r.get("cache") or {} for r in ranks])
    lines = []
    for table, c in stats.items():
        moved = c["bytes_read"] + c["bytes_written"]
        lines.append(
            f"offloaded table {table}: hit rate {c['hit_rate']:.3f} ({c['hits']:,} of {c['lookups']:,} "
            f"rows), {c['rows_read']:,} rows read / {c['rows_written']:,} written back, "
            f"{_size(moved)} moved ({_size(moved / seconds)}/s), {c['evictions']:,} evictions"
        )
    return lines


def _sharded(model: MixedDimDLRM, plan, device_type: str):
    """``(dmp, optimizer, device)``: this rank's DistributedModelParallel of ``model`` and its optimizers."""
    from shardkit.model_parallel import CombinedOptimizer, DistributedModelParallel

    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", dist.get_rank())  # one node: local rank == rank
        torch.cuda.set_device(device)
    dmp = DistributedModelParallel(model.to(device), device=device, plan=plan)
    dense = torch.optim.SGD(dict(dmp.bare_named_parameters()).values(), lr=LR)
    return dmp, CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)]), device


def _weights(dmp) -> dict:
    """This rank's dense weights, table shards (the MC table's too) and MC slot maps, on the CPU."""
    bare = dmp.module
    shards = {k: w.detach().cpu() for k, w in bare.ebc.local_shards().items()}
    maps = {}
    if bare.mc_ebc is not None:
        shards.update({k: w.detach().cpu() for k, w in bare.mc_ebc._embedding_module.local_shards().items()})
        for name, local in bare.mc_ebc._managed_collision_collection._managed_collision_modules.items():
            start = local._output_global_offset
            maps[name] = (start, local._mch_sorted_raw_ids.cpu(), local._mch_remapped_ids_mapping.cpu())
    return {
        "dense": {
            n: p.detach().cpu() for n, p in bare.named_parameters() if not n.startswith(("ebc.", "mc_ebc."))
        },
        "shards": shards,
        "maps": maps,
    }


def run_rank(
    model: MixedDimDLRM,
    plan,
    tables,
    batch_size: int,
    steps: int,
    seed: int,
    device_type: str,
    mc=(),
    checkpoint_dir: Optional[str] = None,
) -> dict:
    """One rank: shard ``model``, train ``steps`` pipelined steps (then save to ``checkpoint_dir``
    when given); losses, weights and seconds."""
    from shardkit.pipeline import TrainPipelineSparseDist

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{world} ranks started; sharding the model and training", file=sys.stderr, flush=True)
    dmp, optimizer, device = _sharded(model, plan, device_type)
    pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
    data = data_source(tables, mc, batch_size, seed)
    batches = (data.batch(step, rank) for step in range(steps))
    bar = ProgressBar(steps) if rank == 0 else None
    losses = []
    dist.barrier()
    begin = time.perf_counter()
    for step in range(steps):
        losses.append(pipeline.progress(batches))
        if bar is not None:
            bar.update(step + 1, progress_note(losses[-1].item()))
    seconds = time.perf_counter() - begin
    # each rank's loss is the mean over its samples; equal batches make their mean the global loss
    mean_losses = torch.stack(losses).double()  # on the device: NCCL reduces device tensors
    dist.all_reduce(mean_losses)
    if checkpoint_dir is not None:
        from shardkit import checkpoint

        checkpoint.save(checkpoint_dir, dmp, {"optim": optimizer})
    cache = dmp.module.ebc.cache_stats()  # before _weights, which writes the caches back
    return {
        "losses": (mean_losses / world).cpu().tolist(),
        "seconds": seconds,
        "cache": cache,
        **_weights(dmp),
    }


def restore_rank(model: MixedDimDLRM, plan, checkpoint_dir: str, device_type: str) -> dict:
    """One rank: shard ``model`` by ``plan`` and load the checkpoint into it; its weights."""
    from shardkit import checkpoint

    dmp, optimizer, _ = _sharded(model, plan, device_type)
    checkpoint.load(checkpoint_dir, dmp, {"optim": optimizer})
    return _weights(dmp)


def restored_differences(saved: List[dict], restored: List[dict]) -> Dict[str, float]:
    """Max abs difference of the restored ranks' dense weights and table shards from the saved ones."""
    extent: Dict[str, tuple] = {}  # every table's full shape, from its shards (the MC table's too)
    for r in saved:
        for t, _, r1, _, c1 in r["shards"]:
            rows, cols = extent.get(t, (0, 0))
            extent[t] = (max(rows, r1), max(cols, c1))
    full = {t: torch.zeros(shape) for t, shape in extent.items()}
    for r in saved:
        for (t, r0, r1, c0, c1), w in r["shards"].items():
            full[t][r0:r1, c0:c1] = w
    # the managed-collision maps: each rank holds entries [start, start + n) of the whole map
    maps: Dict[str, Dict[int, tuple]] = {}
    for r in saved:
        for name, (start, ids, slots) in r["maps"].items():
            for i, pair in enumerate(zip(ids.tolist(), slots.tolist())):
                maps.setdefault(name, {})[start + i] = pair
    out = {
        "dense weights": max(
            (w - saved[0]["dense"][n]).abs().max().item() for r in restored for n, w in r["dense"].items()
        ),
        "embedding tables": max(
            (w - full[t][r0:r1, c0:c1]).abs().max().item()
            for r in restored
            for (t, r0, r1, c0, c1), w in r["shards"].items()
            if w.numel()
        ),
    }
    if maps:
        restored_entries = [
            maps[name].get(start + i) == pair
            for r in restored
            for name, (start, ids, slots) in r["maps"].items()
            for i, pair in enumerate(zip(ids.tolist(), slots.tolist()))
        ]
        # entries that differ, and entries the restored ranks do not hold at all
        total = sum(len(m) for m in maps.values())
        out["mc slot maps"] = float(restored_entries.count(False) + total - len(restored_entries))
    return out


def train_reference(
    model: MixedDimDLRM,
    tables,
    batch_size: int,
    steps: int,
    seed: int,
    world: int,
    progress: Optional[Callable[[int], None]] = None,
    mc=(),
) -> List[float]:
    """Train the unsharded ``model`` in place on the global batches; its loss at each step.

    ``progress(steps_done)`` is called after every step."""
    data = data_source(tables, mc, batch_size, seed)
    optimizer = torch.optim.SGD(dense_parameters(model), lr=LR)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss, _ = model(data.global_batch(step, world))
        loss.backward()  # the tables' fused SGD updates them here
        optimizer.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1)
    return losses


def differences(
    ranks: List[dict], reference: MixedDimDLRM, reference_losses: List[float]
) -> Dict[str, float]:
    """Max abs difference of the losses, the dense weights and the table shards against the reference;
    with a managed-collision table, also the number of slot-map entries that differ."""
    dense = dict(reference.named_parameters())

    def table(name: str) -> torch.Tensor:
        if (
            reference.mc_ebc is not None
            and name in reference.mc_ebc._managed_collision_collection.feature_names()
        ):
            return reference.mc_ebc._embedding_module.table_weight(name)
        return reference.ebc.table_weight(name)

    out = {
        "losses": max(abs(a - b) for a, b in zip(ranks[0]["losses"], reference_losses)),
        "dense weights": max(
            (w - dense[n].detach()).abs().max().item() for r in ranks for n, w in r["dense"].items()
        ),
        "embedding tables": max(
            (w - table(t)[r0:r1, c0:c1].detach()).abs().max().item()
            for r in ranks
            for (t, r0, r1, c0, c1), w in r["shards"].items()
            if w.numel()
        ),
    }
    if reference.mc_ebc is not None:
        maps = reference.mc_ebc._managed_collision_collection._managed_collision_modules
        out["mc slot maps"] = float(
            sum(
                int((ids != maps[n]._mch_sorted_raw_ids[s : s + ids.numel()]).sum())
                + int((slots != maps[n]._mch_remapped_ids_mapping[s : s + ids.numel()]).sum())
                for r in ranks
                for n, (s, ids, slots) in r["maps"].items()
            )
        )
    return out


def progress_note(rank0_loss: float) -> str:
    """The progress bar's note: rank 0 draws it and knows only its own samples' loss, so it says so
    (the summary after training is the global batch mean, over every rank's samples)."""
    return f"rank 0 loss {rank0_loss:.4f}"


def mc_header(table: TableSpec, buckets: int, args) -> str:
    """The header line of the managed-collision table, with the bucket count this run really uses."""
    why = ""
    if buckets != args.nproc:
        why = f": a multiple of {args.nproc} and {restart_world_size(args)} ranks, for the restart"
    return (
        f"managed collision: feature {table.name!r} of raw 64-bit ids ({MC_CARDINALITY:,} distinct, Zipf) "
        f"into {table.rows:,} slots (LFU, eviction every step, {buckets} buckets{why})"
    )


def run(args) -> int:
    """Run the demo as parsed by ``shardkit.cli.demo``; returns the exit code."""
    from shardkit.cli.demo import timeout_env
    from shardkit.testing import run_world

    tables = demo_tables(args.tables, args.max_rows)
    # quantized serving (demo_quant, demo_serve) draws batches without the raw-id feature: no MC table then
    buckets = mc_buckets(args)
    mc = mc_tables(0 if serving(args) else args.mc_slots, buckets)
    model = make_model(tables, args.seed, mc=mc, nproc=buckets)
    rows = sum(t.rows for t in tables)
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(
        f"DLRM: {len(tables)} tables ({rows:,} rows, {sum(t.rows * t.dim for t in tables):,} embedding "
        f"values), {args.nproc} local {args.device.upper()} ranks ({backend}), "
        f"batch {args.batch_size} per rank, {args.steps} steps"
    )
    for t in mc:
        print(mc_header(t, buckets, args))
    plan, plan_text = plan_sharding(model, tables, args, mc)
    print(plan_text)
    if getattr(args, "offload", False):
        offloaded = offload_largest(plan, tables)
        if offloaded is None:
            print(f"{PROG_NAME}: error: --offload needs a table that is not data-parallel", file=sys.stderr)
            return 2
        print(offload_header(offloaded))
    sys.stdout.flush()  # before the ranks' progress bar
    # On a fresh machine the native CPU kernels compile on first use (tens of seconds, with their own
    # notice): here, once, rather than on every rank inside the timed training loop.
    from shardkit.kernels.native_build import native_ops

    native_ops()
    # starting the ranks (spawn, import torch) takes seconds: say so instead of going quiet
    print(f"starting {args.nproc} rank processes ...", file=sys.stderr, flush=True)
    ranks = run_world(
        run_rank,
        args.nproc,
        model,  # pickled: each rank gets its own copy of the same initial weights
        plan,
        tables,
        args.batch_size,
        args.steps,
        args.seed,
        args.device,
        mc,
        args.checkpoint,
        backend=backend,
        env=timeout_env(args),
    )
    seconds = max(r["seconds"] for r in ranks)
    samples = args.steps * args.batch_size * args.nproc
    print(f"throughput: {samples / seconds:,.0f} samples/s ({samples:,} samples in {seconds:.2f} s)")
    for line in offload_summary(ranks, seconds):
        print(line)
    losses = ranks[0]["losses"]
    print(f"loss (global batch mean): {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(curve(losses))

    tolerance = 1e-4 if args.tolerance is None else args.tolerance
    print(
        f"check against an unsharded replica trained on the same global batches (tolerance {tolerance:g}):",
        flush=True,
    )
    bar = ProgressBar(args.steps, "steps of the unsharded replica")
    reference_losses = train_reference(
        model, tables, args.batch_size, args.steps, args.seed, args.nproc, progress=bar.update, mc=mc
    )
    ok = True
    for name, diff in differences(ranks, model, reference_losses).items():
        passed = diff <= tolerance
        ok &= passed
        print(f"  max abs difference of {name:<17} {diff:.3e}  {'ok' if passed else 'FAILED'}")
    print("result: sharded == unsharded" if ok else "result: MISMATCH")
    if ok and getattr(args, "quantize", False):
        from shardkit.cli import demo_quant

        ok = demo_quant.run(model, tables, args, tolerance)
        print("result: quantized sharded == quantized unsharded" if ok else "result: quantized MISMATCH")
    if ok and getattr(args, "serve", False):
        from shardkit.cli import demo_serve

        ok = demo_serve.run(model, tables, args)
        print("result: served answers == trained model" if ok else "result: served answers MISMATCH")
    if args.checkpoint is not None:
        ok &= check_restart(args, tables, ranks, backend)
    return 0 if ok else 1


def serving(args) -> bool:
    """Whether the demo serves the trained model (``--quantize`` or ``--serve``)."""
    return bool(getattr(args, "quantize", False) or getattr(args, "serve", False))


def restart_world_size(args) -> int:
    """Another number of ranks to restart from the checkpoint on: one more when allowed, else one fewer."""
    from shardkit.cli.demo import MAX_RANKS_PER_CPU  # demo imports this module lazily: no cycle

    limit = MAX_RANKS_PER_CPU * (os.cpu_count() or 1) if args.device == "cpu" else torch.cuda.device_count()
    return args.nproc + 1 if args.nproc + 1 <= limit else max(1, args.nproc - 1)


def mc_buckets(args) -> int:
    """Buckets of the managed-collision map: one per rank; with ``--checkpoint`` a multiple of both
    world sizes, since a raw id's bucket (and so its slot) must not change when the world does."""
    if args.checkpoint is None:
        return args.nproc
    return math.lcm(args.nproc, restart_world_size(args))


def check_restart(args, tables, saved: List[dict], backend: str) -> bool:
    """Restore a fresh model from ``args.checkpoint`` on another number of ranks; exact or not."""
    from shardkit.cli.demo import timeout_env
    from shardkit.testing import run_world

    world = restart_world_size(args)
    buckets = mc_buckets(args)
    mc = mc_tables(0 if serving(args) else args.mc_slots, buckets)
    # other initial weights: only the checkpoint can make them equal
    fresh = make_model(tables, args.seed + 1, mc=mc, nproc=buckets)
    plan, _ = plan_sharding(fresh, tables, argparse.Namespace(**{**vars(args), "nproc": world}), mc)
    print(
        f"checkpoint saved to {args.checkpoint}; restoring it on {world} ranks (another plan) ...", flush=True
    )
    restored = run_world(
        restore_rank, world, fresh, plan, args.checkpoint, args.device, backend=backend, env=timeout_env(args)
    )
    ok = True
    for name, diff in restored_differences(saved, restored).items():
        ok &= diff == 0
        print(f"  restored {name:<17} max abs difference {diff:.3e}  {'exact' if diff == 0 else 'FAILED'}")
    print(f"result: restored on {world} ranks == saved on {args.nproc}" if ok else "result: RESTORE MISMATCH")
    return ok
