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
``--floor`` adds ``floor``: no library, the golden program's dense model under torch's DDP with a bare
Adagrad, a free "lookup" and only the all-to-alls every library must make (``build_floor``): the
fastest any library's step could be on this machine, so ``floor/torchrec`` bounds the ratio any
library can reach over torchrec. ``--floor-parts`` adds its parts (dense alone, + DDP, + output dist).
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
# not libraries: the floor of the step for any library (``--floor``, see ``build_floor``) and, with
# ``--floor-parts``, its parts: the dense model alone, + DDP, + the output dist's two all-to-alls
FLOOR = "floor"
FLOOR_PARTS = ("floor:dense", "floor:ddp", "floor:ddp+out")
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


class _FloorPipeline:
    """``progress`` of the floor step (see ``build_floor``)."""

    def __init__(self, model, dense_optimizer, pg_send_bytes: int, input_dist: bool) -> None:
        import torch

        self._model, self._optimizer, self._input_dist = model, dense_optimizer, input_dist
        self._ids = torch.zeros(pg_send_bytes, dtype=torch.uint8)
        self._ids_out = torch.empty_like(self._ids)
        self._pending = None

    def progress(self, batches):
        import torch
        import torch.distributed as dist

        batch = next(batches)
        self._optimizer.zero_grad()
        if not self._input_dist:
            losses, output = self._model(batch)
            torch.sum(losses).backward()
            self._optimizer.step()
            return output
        if self._pending is not None:  # last step's input dist: waited by this step's forward
            self._pending.wait()
        # the next batch's ids (lengths and values as bytes) in one all-to-all, overlapped with this step
        self._pending = dist.all_to_all_single(self._ids_out, self._ids, async_op=True)
        losses, output = self._model(batch)
        torch.sum(losses).backward()
        self._optimizer.step()
        return output


def build_floor(cfg: Dict[str, Any], part: str = FLOOR):
    """The floor of the DLRM step for any library: the golden program's dense model (DLRMTrain's
    dense arch, interaction, over arch, loss; shardkit's copy of torchrec's code), wrapped in torch's
    DDP and trained by a bare ``torch.optim.Adagrad``, with the communication every library must make
    and no library code around it: the pooled embeddings arrive by one blocking all-to-all of the
    step's sizes (a free "lookup": a leaf tensor), their gradient returns by one, and each step
    overlaps one all-to-all of the next batch's ids (lengths and values, as bytes). No input check,
    no splits exchange, no lookup kernel, no optimizer of the tables. Table-wise sizes (the tables'
    columns split over the ranks as ``--sharding table_wise`` places them).

    ``part`` (``--floor-parts``): ``floor:dense``, the dense model alone (no DDP, no communication; the
    pooled embeddings a local reshape of the leaf); ``floor:ddp``, with DDP; ``floor:ddp+out``, with
    DDP and the output dist's two all-to-alls; ``floor``, all of it (the input dist's all-to-all too).
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    from shardkit.models import dlrm as dlrm_mod
    from shardkit.sparse import KeyedTensor

    world, rank = dist.get_world_size(), dist.get_rank()
    lib_cfg = dict(cfg, sharding="table_wise")
    keys = [f"f{i}" for i in range(cfg["tables"])]
    owned = [sum(1 for i in range(cfg["tables"]) if i % world == r) for r in range(world)]
    batch, dim = cfg["batch"], cfg["dim"]

    class _AllToAll(torch.autograd.Function):
        """``[W * B, cols_me]`` (every rank's samples of this rank's tables) -> ``[B, all cols]``
        (this rank's samples, columns in rank order); backward the reverse. Blocking, equal batches."""

        @staticmethod
        def forward(ctx, local):
            send = local.contiguous()
            out = torch.empty(world * batch * max(owned) * dim, dtype=local.dtype)
            recv = [batch * owned[r] * dim for r in range(world)]
            out = out[: sum(recv)]
            dist.all_to_all_single(out, send.view(-1), recv, [batch * owned[rank] * dim] * world)
            blocks = [b.view(batch, -1) for b in out.split(recv)]
            return torch.cat(blocks, dim=1)

        @staticmethod
        def backward(ctx, grad):
            cols = [owned[r] * dim for r in range(world)]
            send = torch.cat([g.contiguous().view(-1) for g in grad.split(cols, dim=1)])
            out = torch.empty(world * batch * owned[rank] * dim, dtype=grad.dtype)
            dist.all_to_all_single(out, send, [batch * owned[rank] * dim] * world, [batch * c for c in cols])
            return out.view(world * batch, owned[rank] * dim)

    class FreeLookup(nn.Module):
        """Stands in for the sharded collection: its pooled output costs two all-to-alls, no lookup."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("local", torch.randn(world * batch, owned[rank] * dim) * 0.01)
            # the output's columns: rank 0's tables, then rank 1's, ... (table-wise round-robin)
            self._keys = [k for r in range(world) for i, k in enumerate(keys) if i % world == r]

        def forward(self, features):
            local = self.local.detach().requires_grad_()
            if part in ("floor:dense", "floor:ddp"):  # no all-to-all: this rank's rows, reshaped
                pooled = local.view(world, batch, -1).permute(1, 0, 2).reshape(batch, -1)
                return KeyedTensor(self._keys, [dim] * len(self._keys), pooled)
            pooled = _AllToAll.apply(local)
            return KeyedTensor(self._keys, [dim] * len(self._keys), pooled)

    from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[key])
        for i, (key, rows) in enumerate(zip(keys, table_rows(lib_cfg)))
    ]
    dlrm = dlrm_mod.DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13,
        dense_arch_layer_sizes=[64, dim],
        over_arch_layer_sizes=[64, 1],
        dense_device=torch.device("cpu"),
    )
    dlrm.sparse_arch.embedding_bag_collection = FreeLookup()
    train_model = dlrm_mod.DLRMTrain(dlrm) if cfg["model"] == "dlrm" else _ConcatTrain(dlrm)
    model = (
        train_model
        if part == "floor:dense"
        else nn.parallel.DistributedDataParallel(train_model, static_graph=True, gradient_as_bucket_view=True)
    )
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    from shardkit.datasets.random import RandomRecDataset

    dataset = RandomRecDataset(
        keys=keys, batch_size=batch, hash_sizes=table_rows(lib_cfg), ids_per_feature=cfg["pooling"],
        num_dense=13, manual_seed=rank, num_generated_batches=8,
    )  # fmt: skip
    # lengths (int64, one per bag) and values (int64, ``pooling`` per bag) of this rank's batch
    ids_bytes = world * ((batch * cfg["tables"] * (1 + cfg["pooling"]) * 8) // world)
    pipeline = _FloorPipeline(model, optimizer, ids_bytes, input_dist=part == FLOOR)
    return pipeline, iter(dataset), part


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
    packages = () if lib.startswith(FLOOR) else packages
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
        if lib.startswith(FLOOR):
            pipeline, batches, plan_summary = build_floor(cfg, lib)
        else:
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
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run 'floor': the dense model (DDP, Adagrad) and the step's unavoidable all-to-alls "
        "with no library code (build_floor): the fastest any library's step could be",
    )
    parser.add_argument(
        "--floor-parts", action="store_true", help="with --floor: also its parts (see build_floor)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps and one round (~1 min)")
    parser.add_argument("--top", type=int, default=0, help="print the N costliest functions")
    parser.add_argument("--label", default="", help="suffix of the JSON name (e.g. 'before')")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.profile_steps, args.rounds = 100, 10, 30, 1
    libs = [lib for lib in args.libs.split(",") if lib] + (["shardkit@base"] if args.base_src else [])
    libs += ([FLOOR] if args.floor else []) + (list(FLOOR_PARTS) if args.floor and args.floor_parts else [])
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
    if FLOOR in best and "torchrec" in best:  # the most any library could gain over torchrec
        floor, torch_rec = best[FLOOR], best["torchrec"]
        rows.append({"name": "floor/torchrec", "steps/s": floor["steps/s"] / torch_rec["steps/s"],
                     "cpu ms/step": floor["cpu ms/step"] / torch_rec["cpu ms/step"]})  # fmt: skip
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
