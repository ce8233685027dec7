"""Fixed cost of the whole DLRM training step at small batches and many tables, vs torchrec.

Run from the repository root: ``python -m benchmarks.step_overhead [--quick]``; in the torchrec peer
venv (``PYTHONPATH=src:. $HOME/peers/torchrec/bin/python -m benchmarks.step_overhead``) it runs
torchrec's golden DLRM step and shardkit's in one run, in alternating rounds; where torchrec is not
importable it runs shardkit alone.

The step is torchrec's golden DLRM training program written once against torchrec's module tree and
resolved to either library (``torchrec.X`` or ``shardkit.X``, the same names; docs/names.md): a
``DLRMTrain`` over an ``EmbeddingBagCollection`` of ``--tables`` tables (rows spread log-uniformly over
``--rows``, dim ``--dim``), fused row-wise Adagrad from the sharder's ``fused_params``, the dense
parameters trained by ``torch.optim.Adagrad`` through ``KeyedOptimizerWrapper`` /
``CombinedOptimizer``, ``TrainPipelineSparseDist`` over ``RandomRecDataset`` batches of ``--batch``
samples per rank; ``--ranks`` CPU ranks on gloo with one torch thread each; one forced plan
(``--sharding``: every table table-wise round-robin, row-wise, column-wise, or ``mixed`` = alternately
table-wise and row-wise, all with the fused kernel) so that both libraries run the same plan, or
``planner``: each library's own ``EmbeddingShardingPlanner`` as the golden program does (the plans
may then differ; each run prints its plan). ``--model concat`` replaces DLRM's pairwise interaction by a
concatenation of the pooled embeddings (with hundreds of tables the ``F^2`` dot products would be
most of the step). shardkit's input validation is
switched off (torchrec has none) unless ``--validation``.

Per library, per round (a new pair of processes each):
- ``steps/s``: ``--steps`` pipeline steps after ``--warmup``, the slowest rank's wall time;
- ``cpu ms/step``: process CPU time per step (all threads, gloo's included), mean over ranks;
- then ``--profile-steps`` more steps under cProfile (timed by the main thread's CPU time, so that a
  busy machine's preemptions are not charged to the function that waited) on every rank, from which,
  per step on rank 0:
  ``py ms/step``: self time of the library's own Python functions (torchrec + fbgemm_gpu, or shardkit;
  time in C functions they call is not included), ``py us/table`` = that / tables,
  ``all py ms/step``: self time of every Python function (torch's included), ``calls/step`` of the
  library's functions, ``collectives/step`` (torch's C collectives started), ``host syncs/step``
  (``Tensor.item`` / ``tolist`` / ``nonzero`` calls). cProfile slows Python down: these columns compare
  the libraries with each other, not with ``steps/s``.
``--base-src DIR`` adds a third library, ``shardkit@base``: shardkit imported from ``DIR`` (another
checkout's ``src/``), for before/after comparisons in one run.
The last rows give, per column, shardkit over torchrec (and over shardkit@base) (best round of each;
> 1 on ``steps/s`` is shardkit faster). ``--top N`` prints each library's N most expensive functions
(self time) of rank 0: its own, then all (torch's and C functions included).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import importlib.util
import math
import os
import pstats
import socket
import sys
import time
from typing import Any, Dict, List, Optional

LIBS = ("torchrec", "shardkit")
SHARDINGS = ("table_wise", "row_wise", "column_wise", "mixed", "planner")
# torch's C collectives (what one Python wrapper such as all_gather_object may call several of)
COLLECTIVES = {
    "all_to_all_single", "all_gather_single", "allgather", "allreduce", "broadcast", "alltoall",
    "alltoall_base", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
    "_allgather_base", "allgather_into_tensor_coalesced", "allreduce_coalesced", "barrier",
    "monitored_barrier", "send", "recv", "recv_anysource", "gather", "scatter", "reduce",
}  # fmt: skip
HOST_SYNCS = ("'item' of", "'tolist' of", "method nonzero", "'nonzero' of")


def _lib(lib: str, name: str):
    """``torchrec.<name>`` or ``shardkit.<name>`` (fbgemm_gpu likewise)."""
    if name.startswith("fbgemm_gpu"):
        return importlib.import_module(name if lib == "torchrec" else "shardkit." + name)
    return importlib.import_module(f"{lib}.{name}" if name else lib)


def table_rows(cfg: Dict[str, Any]) -> List[int]:
    """Rows of each table, log-uniform over [rows_min, rows_max] (deterministic)."""
    n, lo, hi = cfg["tables"], math.log(cfg["rows_min"]), math.log(cfg["rows_max"])
    return [int(round(math.exp(lo + (hi - lo) * (i / max(n - 1, 1))))) for i in range(n)]


def build(lib: str, cfg: Dict[str, Any]):
    """The golden DLRM training pipeline and its batch iterator, from ``lib``'s names."""
    import torch
    import torch.distributed as dist

    tr = _lib(lib, "")
    emb_optim = _lib(lib, "fbgemm_gpu.split_embedding_configs").EmbOptimType
    dlrm_mod = _lib(lib, "models.dlrm")
    sharder = _lib(lib, "distributed.embeddingbag").EmbeddingBagCollectionSharder(
        fused_params={"optimizer": emb_optim.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    plan_mod = _lib(lib, "distributed.sharding_plan")
    world = dist.get_world_size()
    keys = [f"f{i}" for i in range(cfg["tables"])]
    tables = [
        tr.EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=cfg["dim"], num_embeddings=rows, feature_names=[key]
        )
        for i, (key, rows) in enumerate(zip(keys, table_rows(cfg)))
    ]
    torch.manual_seed(0)
    dlrm = dlrm_mod.DLRM(
        embedding_bag_collection=tr.EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13,
        dense_arch_layer_sizes=[64, cfg["dim"]],
        over_arch_layer_sizes=[64, 1],
        dense_device=torch.device("cpu"),
    )
    train_model = dlrm_mod.DLRMTrain(dlrm) if cfg["model"] == "dlrm" else _ConcatTrain(dlrm)
    ebc_path = "model.sparse_arch.embedding_bag_collection"
    fused = "fused"  # the golden program's kernel (a generator's default would be the dense one)
    generators = {
        "table_wise": lambda i: plan_mod.table_wise(rank=i % world, compute_kernel=fused),
        "row_wise": lambda i: plan_mod.row_wise(compute_kernel=fused),
        "column_wise": lambda i: plan_mod.column_wise(ranks=list(range(world)), compute_kernel=fused),
        "mixed": lambda i: (
            plan_mod.table_wise(rank=(i // 2) % world, compute_kernel=fused)
            if i % 2 == 0
            else plan_mod.row_wise(compute_kernel=fused)
        ),
    }.get(cfg["sharding"])
    if cfg["sharding"] == "planner":  # the golden program's: each library's own planner
        planner_mod = _lib(lib, "distributed.planner")
        planner = planner_mod.EmbeddingShardingPlanner(
            topology=planner_mod.Topology(world_size=world, compute_device="cpu")
        )
        plan = planner.collective_plan(train_model, [sharder], dist.GroupMember.WORLD)
    else:
        module_plan = plan_mod.construct_module_sharding_plan(
            train_model.get_submodule(ebc_path),
            {t.name: generators(i) for i, t in enumerate(tables)},
            sharder=sharder,
            local_size=world,
            world_size=world,
            device_type="cpu",
        )
        plan = _lib(lib, "distributed.types").ShardingPlan({ebc_path: module_plan})
    model = _lib(lib, "distributed").DistributedModelParallel(
        module=train_model, device=torch.device("cpu"), plan=plan, sharders=[sharder]
    )
    keyed = _lib(lib, "optim.keyed")
    dense_optimizer = keyed.KeyedOptimizerWrapper(
        dict(_lib(lib, "optim.optimizers").in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05),
    )
    optimizer = keyed.CombinedOptimizer([model.fused_optimizer, dense_optimizer])
    pipeline = _lib(lib, "distributed.train_pipeline").TrainPipelineSparseDist(
        model, optimizer, torch.device("cpu")
    )
    dataset = _lib(lib, "datasets.random").RandomRecDataset(
        keys=keys,
        batch_size=cfg["batch"],
        hash_sizes=table_rows(cfg),
        ids_per_feature=cfg["pooling"],
        num_dense=13,
        manual_seed=dist.get_rank(),
        num_generated_batches=8,
    )
    kinds = sorted(
        f"{sharding.sharding_type}/{sharding.compute_kernel}"
        for module_plan in plan.plan.values()
        for sharding in module_plan.values()
    )
    plan_summary = " ".join(f"{kinds.count(k)}x{k}" for k in sorted(set(kinds)))
    return pipeline, iter(dataset), plan_summary


class _ConcatTrain:  # defined lazily (torch.nn is imported in the workers only); see _concat_train
    def __new__(cls, dlrm):
        return _concat_train(dlrm)


def _concat_train(dlrm):
    """DLRMTrain with the pairwise interaction replaced by a concatenation (``--model concat``): with
    hundreds of tables the interaction's ``F^2`` dot products would dominate the step. Same
    submodule names and outputs as DLRMTrain, same sparse and dense archs."""
    import torch
    from torch import nn

    class ConcatDLRM(nn.Module):
        def __init__(self, dlrm) -> None:
            super().__init__()
            self.sparse_arch, self.dense_arch = dlrm.sparse_arch, dlrm.dense_arch
            features = len(dlrm.sparse_arch.embedding_bag_collection.embedding_bag_configs()) + 1
            dim = dlrm.sparse_arch.embedding_bag_collection.embedding_bag_configs()[0].embedding_dim
            self.over_arch = nn.Sequential(nn.Linear(features * dim, 64), nn.ReLU(), nn.Linear(64, 1))

        def forward(self, dense, sparse):
            embedded = self.sparse_arch(sparse)  # [B, F, D]
            combined = torch.cat((self.dense_arch(dense), embedded.flatten(1)), dim=1)
            return self.over_arch(combined)

    class ConcatTrain(nn.Module):
        def __init__(self, dlrm) -> None:
            super().__init__()
            self.model = ConcatDLRM(dlrm)

        def forward(self, batch):
            logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
            return loss, (loss.detach(), logits.detach(), batch.labels.detach())

    return ConcatTrain(dlrm)


def _c_name(name: str) -> str:
    """``all_gather_single`` of ``<built-in method torch._C._distributed_c10d.all_gather_single>`` or
    ``allreduce`` of ``<method 'allreduce' of 'torch._C._distributed_c10d.ProcessGroup' objects>``."""
    if name.startswith("<method '"):
        return name.split("'")[1]
    return name.rstrip(">").rsplit(".", 1)[-1]


def _profile_summary(prof: cProfile.Profile, lib: str, steps: int, tables: int, top: int) -> Dict[str, Any]:
    """Per-step figures of one cProfile run (see the module docstring)."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    packages = ("torchrec", "fbgemm_gpu") if lib == "torchrec" else ("shardkit",)
    roots = [os.path.dirname(importlib.import_module(p).__file__) + os.sep for p in packages]
    own = all_py = 0.0
    own_calls = collectives = syncs = 0
    rows, every = [], []
    for (path, line, name), (_cc, calls, tottime, _cum, _callers) in stats.items():
        every.append((tottime, calls, f"{os.sep.join(path.split(os.sep)[-3:])}:{line}({name})"))
        if path == "~":  # a C function
            if any(tag in name for tag in HOST_SYNCS):
                syncs += calls
            if "_distributed_c10d" in name and _c_name(name) in COLLECTIVES:
                collectives += calls
            continue
        all_py += tottime
        if any(path.startswith(root) for root in roots):
            own += tottime
            own_calls += calls
            rows.append((tottime, calls, f"{path.split(os.sep + lib + os.sep)[-1]}:{line}({name})"))
    rows.sort(reverse=True)
    every.sort(reverse=True)
    return {
        "py ms/step": 1e3 * own / steps,
        "py us/table": 1e6 * own / steps / tables,
        "all py ms/step": 1e3 * all_py / steps,
        "calls/step": own_calls / steps,
        "collectives/step": collectives / steps,
        "host syncs/step": syncs / steps,
        "top": [(1e3 * t / steps, c / steps, where) for t, c, where in rows[:top]],
        "top_all": [(1e3 * t / steps, c / steps, where) for t, c, where in every[:top]],
    }


def _worker(rank: int, lib: str, cfg: Dict[str, Any], port: int, queue) -> None:
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    if lib == "shardkit@base":  # another checkout's shardkit (a before/after comparison)
        sys.path.insert(0, cfg["base_src"])
        lib = "shardkit"
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cfg["ranks"])
    try:
        if lib == "shardkit":
            from shardkit.distributed.validation import set_validation

            set_validation(cfg["validation"])
        pipeline, batches, plan_summary = build(lib, cfg)
        for _ in range(cfg["warmup"]):
            pipeline.progress(batches)
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(cfg["steps"]):
            pipeline.progress(batches)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        # the main thread's CPU time, not wall time: on a loaded machine a preempted function would
        # be charged the time it waited for a core
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        for _ in range(cfg["profile_steps"]):
            pipeline.progress(batches)
        prof.disable()
        summary = _profile_summary(prof, lib, cfg["profile_steps"], cfg["tables"], cfg["top"])
        gathered: List[Any] = [None] * cfg["ranks"]
        dist.all_gather_object(gathered, (wall, cpu))
        if rank == 0:
            walls, cpus = zip(*gathered)
            queue.put(
                {
                    "steps/s": cfg["steps"] / max(walls),
                    "cpu ms/step": 1e3 * sum(cpus) / len(cpus) / cfg["steps"],
                    **summary,
                    "plan": plan_summary,
                }
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_lib(lib: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """One round of ``lib``: a fresh world of ``cfg['ranks']`` processes; rank 0's summary."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker, args=(lib, cfg, _free_port(), queue), nprocs=cfg["ranks"], start_method="spawn"
    )
    return queue.get()


def available_libs() -> List[str]:
    """shardkit, and torchrec when this interpreter can import it (the peer venv)."""
    return [lib for lib in LIBS if lib == "shardkit" or importlib.util.find_spec(lib) is not None]


def main(argv: Optional[List[str]] = None) -> None:
    from benchmarks.common import write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, nargs=2, default=[1000, 100_000], metavar=("MIN", "MAX"))
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank")
    parser.add_argument("--pooling", type=int, default=2, help="max ids per bag (RandomRecDataset)")
    parser.add_argument("--sharding", default="table_wise", choices=SHARDINGS)
    parser.add_argument(
        "--model", default="dlrm", choices=("dlrm", "concat"), help="concat: no pairwise interaction"
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per library")
    parser.add_argument("--libs", default=",".join(available_libs()))
    parser.add_argument(
        "--base-src",
        help="also run shardkit imported from this directory (another checkout's src/) as 'shardkit@base'",
    )
    parser.add_argument(
        "--validation", action="store_true", help="keep shardkit's input validation on (its default)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps and one round (~1 min)")
    parser.add_argument("--top", type=int, default=0, help="print the N costliest functions")
    parser.add_argument("--label", default="", help="suffix of the JSON name (e.g. 'before')")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.profile_steps, args.rounds = 100, 10, 30, 1
    libs = [lib for lib in args.libs.split(",") if lib] + (["shardkit@base"] if args.base_src else [])
    cfg = {
        "ranks": args.ranks, "tables": args.tables, "rows_min": args.rows[0], "rows_max": args.rows[1],
        "dim": args.dim, "batch": args.batch, "pooling": args.pooling, "sharding": args.sharding,
        "model": args.model, "validation": args.validation, "steps": args.steps,
        "warmup": args.warmup, "profile_steps": args.profile_steps,
        "top": args.top, "base_src": os.path.abspath(args.base_src) if args.base_src else None,
    }  # fmt: skip
    rows: List[Dict[str, Any]] = []
    best: Dict[str, Dict[str, Any]] = {}
    for round_ in range(args.rounds):
        for lib in libs if round_ % 2 == 0 else libs[::-1]:
            result = run_lib(lib, cfg)
            top, top_all = result.pop("top"), result.pop("top_all")
            print(f"{lib} plan: {result.pop('plan')}", file=sys.stderr, flush=True)
            rows.append({"name": f"{lib} round {round_}", **result})
            print(f"{lib} round {round_}: {result['steps/s']:.1f} steps/s", file=sys.stderr, flush=True)
            if lib not in best or result["steps/s"] > best[lib]["steps/s"]:
                best[lib] = {**result, "top": top, "top_all": top_all}
    if "torchrec" in best and "shardkit" in best:
        shard, torch_rec = best["shardkit"], best["torchrec"]
        ratio = {k: shard[k] / torch_rec[k] for k in shard if not k.startswith("top") and torch_rec[k]}
        rows.append({"name": "shardkit/torchrec", **ratio})
    if "shardkit@base" in best and "shardkit" in best:
        shard, base = best["shardkit"], best["shardkit@base"]
        rows.append(
            {
                "name": "shardkit/base",
                **{k: shard[k] / base[k] for k in shard if not k.startswith("top") and base[k]},
            }
        )
    name = "step_overhead" + (f"_{args.label}" if args.label else "")
    write_results(name, {**cfg, "libs": libs, "rounds": args.rounds, "threads_per_rank": 1}, rows, args.out)
    for lib in best if args.top else ():
        for key, what in (("top", f"{lib}'s own"), ("top_all", "all (C functions too)")):
            print(f"{lib}: the {args.top} costliest functions, {what}, rank 0, per step (self ms, calls):")
            for millis, calls, where in best[lib][key]:
                print(f"  {millis:7.3f} ms {calls:7.1f}  {where}")


if __name__ == "__main__":
    main()
