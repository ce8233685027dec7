"""shardkit vs torchrec, side by side: the training step of a sharded EmbeddingBagCollection.

Run from the repository root in an environment that has both libraries: shardkit and torchrec 1.8.0 with
fbgemm-gpu 1.8.0 (the releases built for torch 2.13; :func:`missing_peer_message` gives the pip commands).
Without them it says which package to install and exits 0.

Both libraries get the same tables (``--tables`` x ``--rows`` x ``--dim`` fp32, or widths ``--dims`` in turn,
SUM pooling), the same
forced plan per sharding type, the same batches (``--batch`` samples per rank, bag lengths uniform in
``[1, 2 * pooling - 1]``, uniform ids), the same weights, and a fused optimizer applied in backward
(``--optimizer sgd|adagrad|rowwise_adagrad``; dense tables under data_parallel get the same rule as a
dense optimizer: torch.optim's, or each library's own ``RowWiseAdagrad``).
The step is ``loss = pooled.pow(2).mean(); loss.backward(); optimizer.step()``, 1 torch thread per rank,
gloo. Before timing, each library's forward is checked against ``F.embedding_bag`` on the same weights
(``fwd_max_abs_diff``). The libraries alternate for ``--rounds`` rounds and each keeps its best round.

Columns: steps per second (the slowest rank's wall time), main-thread CPU milliseconds per step (the
busiest rank; less sensitive than wall time to other load on a shared machine) and the ratios
shardkit/torchrec of both (> 1 means shardkit is faster).

``--sweep`` runs :mod:`benchmarks.vs_torchrec_sweep` (a grid of shapes) instead; its options follow.
Without torchrec here and with ``$SHARDKIT_TORCHREC_PYTHON`` set, the script re-runs under that Python.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import write_results

# the peer this benchmark was measured against: torchrec and fbgemm-gpu releases built for torch 2.13
TORCHREC_VERSION = "1.8.0"
FBGEMM_VERSION = "1.8.0"
# torchrec's own runtime dependencies, installed by hand where torchrec is installed with --no-deps
TORCHREC_DEPS = "tensordict==0.15.3 torchmetrics==1.0.3 pyre-extensions==0.0.32"


def missing_peers() -> List[str]:
    """The import names of the peer packages this Python lacks (``torchrec``, ``fbgemm_gpu``)."""
    return [name for name in ("torchrec", "fbgemm_gpu") if importlib.util.find_spec(name) is None]


def peer_python() -> Optional[str]:
    """A Python that has torchrec, named by ``$SHARDKIT_TORCHREC_PYTHON`` (e.g. the venv that
    ``../shared/peers/setup.sh`` builds, ``~/peers/torchrec/bin/python``); None when unset, inside such
    a re-run, or when it is this Python. Raises ``FileNotFoundError`` when it names no file."""
    chosen = os.environ.get("SHARDKIT_TORCHREC_PYTHON")
    if not chosen or os.environ.get("_SHARDKIT_PEER_RERUN"):
        return None
    if not os.path.isfile(chosen):
        raise FileNotFoundError(f"SHARDKIT_TORCHREC_PYTHON={chosen}: no such file")
    # venv pythons are links to one interpreter: compare the paths as given, not resolved
    return None if os.path.abspath(chosen) == os.path.abspath(sys.executable) else chosen


def run_under_peer_python(module: str, argv: Optional[List[str]]) -> bool:
    """Re-run ``python -m module argv`` under :func:`peer_python` with THIS checkout's shardkit first on
    the path (so ``./dev bench`` measures the working tree); False when there is no such Python. Exits
    with the re-run's exit code when it fails."""
    python = peer_python()
    if python is None:
        return False
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root / "src"), str(root), os.environ.get("PYTHONPATH")]))
    argv = sys.argv[1:] if argv is None else argv
    print(f"{module}: torchrec is not installed here; running under {python} (shardkit from {root / 'src'})")
    sys.stdout.flush()
    env = {**os.environ, "PYTHONPATH": path, "_SHARDKIT_PEER_RERUN": "1"}
    done = subprocess.run([python, "-m", module, *argv], cwd=root, env=env)
    if done.returncode != 0:
        sys.exit(done.returncode)
    return True


def handled_without_peers(name: str, argv: Optional[List[str]], out: Optional[str]) -> bool:
    """True when this Python lacks torchrec / fbgemm-gpu and ``benchmarks.<name>`` was dealt with: re-run
    under :func:`peer_python`, or a "skipped" result written with what to install. False: measure here."""
    missing = missing_peers()
    if not missing:
        return False
    if not run_under_peer_python(f"benchmarks.{name}", argv):
        print(missing_peer_message(missing))
        write_results(name, {"skipped": f"not installed: {', '.join(missing)}"}, [], out)
    return True


def missing_peer_message(missing: List[str]) -> str:
    """What to install, in pip's terms, for the packages ``missing`` (import names)."""
    python = sys.executable
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    return (
        f"vs_torchrec: nothing to compare: {' and '.join(missing)} not installed in this Python ({python}). "
        f"The comparison runs torchrec {TORCHREC_VERSION} with fbgemm-gpu {FBGEMM_VERSION} next to "
        "shardkit in one environment; install them into it (the torch pin keeps pip from replacing torch):\n"
        f"  with CUDA: {python} -m pip install {torch_pin} torchrec=={TORCHREC_VERSION} "
        f"fbgemm-gpu=={FBGEMM_VERSION}\n"
        f"  CPU only:  {python} -m pip install {torch_pin} fbgemm-gpu-cpu=={FBGEMM_VERSION} {TORCHREC_DEPS} "
        f"&& {python} -m pip install --no-deps torchrec=={TORCHREC_VERSION}\n"
        "  (torchrec's metadata requires the CUDA package fbgemm-gpu; on a CPU machine it is installed "
        "without its dependencies, next to fbgemm-gpu-cpu). Then rerun: python -m benchmarks.vs_torchrec"
    )


SHARDING_TYPES = ["table_wise", "row_wise", "column_wise", "data_parallel"]
# grid_shard runs with one rank per node (a column block per rank, its rows on that rank): torchrec cuts
# 128-column blocks and needs one per node, so its --dim must be 128 x --world
OPTIONAL_TYPES = ["grid_shard", "table_row_wise"]
OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad"]
LR = 0.01


def table_rows(args: Dict[str, Any]) -> List[int]:
    """Rows of each table: ``args["table_rows"]`` (the sweep's mixed sizes), else ``args["rows"]`` each."""
    return list(args.get("table_rows") or [args["rows"]] * args["tables"])


def table_dims(args: Dict[str, Any]) -> List[int]:
    """Width of each table: ``args["dims"]`` in turn (tables of several widths: several lookup groups),
    else ``args["dim"]`` each."""
    dims = args.get("dims") or [args["dim"]]
    return [dims[i % len(dims)] for i in range(args["tables"])]


def _batches(args: Dict[str, Any], rank: int, count: int = 4) -> List[tuple]:
    """``count`` batches ``(values int64, lengths int64 [tables * batch])``, feature-major like a KJT."""
    gen = torch.Generator().manual_seed(1000 + rank)
    rows = torch.tensor(table_rows(args), dtype=torch.float64).repeat_interleave(args["batch"])
    out = []
    for _ in range(count):
        lengths = torch.randint(1, 2 * args["pooling"], (args["tables"] * args["batch"],), generator=gen)
        # uniform ids in [0, rows of the bag's table)
        limit = rows.repeat_interleave(lengths)
        values = (torch.rand(limit.numel(), generator=gen, dtype=torch.float64) * limit).long()
        out.append((values, lengths))
    return out


def _full_tables(args: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(12345)
    return {
        f"t{i}": torch.empty(rows, dim).uniform_(-0.01, 0.01, generator=gen)
        for i, (rows, dim) in enumerate(zip(table_rows(args), table_dims(args)))
    }


def _reference(args: Dict[str, Any], tables: Dict[str, torch.Tensor], values, lengths) -> List[torch.Tensor]:
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    out = []
    for i in range(args["tables"]):
        lo, hi = i * args["batch"], (i + 1) * args["batch"]
        ids = values[offsets[lo] : offsets[hi]]
        bag_starts = offsets[lo:hi] - offsets[lo]
        out.append(F.embedding_bag(ids, tables[f"t{i}"], bag_starts, mode="sum"))
    return out


def _load_tables(state: Dict[str, Any], tables: Dict[str, torch.Tensor]) -> None:
    """Copy each full table into this rank's part of the state-dict entry ``...tN.weight``."""
    with torch.no_grad():
        for key, value in state.items():
            match = re.search(r"(t\d+)\.weight$", key)
            if match is None:
                continue
            full = tables[match.group(1)]
            if hasattr(value, "local_shards"):  # ShardedTensor
                for shard in value.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
            elif hasattr(value, "to_local"):  # DTensor
                from torch.distributed.tensor import distribute_tensor

                value.to_local().copy_(
                    distribute_tensor(full, value.device_mesh, value.placements).to_local()
                )
            else:
                value.copy_(full)


def _build_torchrec(args: Dict[str, Any], kind: str):
    import torchrec.distributed.comm as torchrec_comm
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    # torchrec caches its node groups per process; a pooled worker runs several worlds in turn
    torchrec_comm._INTRA_PG = torchrec_comm._CROSS_PG = None
    fused = {
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }[args["optimizer"]]
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": fused, "learning_rate": LR})
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i, (rows, dim) in enumerate(zip(table_rows(args), table_dims(args)))
    ]
    module = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        module,
        _generators(kind, "torchrec", args["tables"], EmbeddingComputeKernel.FUSED.value),
        sharder=sharder,
        local_size=_local_size(),
        world_size=dist.get_world_size(),
        device_type="cpu",
    )
    if kind == "table_row_wise":
        # torchrec's table_row_wise generator takes no kernel and gives DENSE (full-table gradients and
        # the dense optimizer); the other types run FUSED, and so must this one
        for sharding in plan.values():
            sharding.compute_kernel = EmbeddingComputeKernel.FUSED.value
    model = DistributedModelParallel(
        _Wrapper(module),
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],
    )
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    optimizers = [("fused", model.fused_optimizer)]
    if dense:
        dense_cls = _dense_optimizer(args, "torchrec")
        optimizers.append(("dense", KeyedOptimizerWrapper(dense, lambda params: dense_cls(params, lr=LR))))
    keys = [f"f{i}" for i in range(args["tables"])]
    return model, CombinedOptimizer(optimizers), lambda v, n: KeyedJaggedTensor.from_lengths_sync(keys, v, n)


def _build_shardkit(args: Dict[str, Any], kind: str):
    from shardkit.distributed.sharding_env import ShardingEnv
    from shardkit.distributed.validation import set_validation
    from shardkit.model_parallel import DistributedModelParallel
    from shardkit.modules import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder
    from shardkit.sharding.sharding_plan import construct_module_sharding_plan
    from shardkit.sharding.types import ShardingPlan
    from shardkit.sparse import KeyedJaggedTensor

    set_validation(False)  # as torchrec, which does not compare the ranks' inputs either
    configs = [
        EmbeddingBagConfig(rows, dim, name=f"t{i}", feature_names=[f"f{i}"])
        for i, (rows, dim) in enumerate(zip(table_rows(args), table_dims(args)))
    ]
    names = {"sgd": "SGD", "adagrad": "ADAGRAD", "rowwise_adagrad": "ROWWISE_ADAGRAD"}
    fused = FusedOptimizerConfig(names[args["optimizer"]], lr=LR)
    module = EmbeddingBagCollection(configs, fused_optimizer=fused, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        module,
        _generators(kind, "shardkit", args["tables"], dp_kernel=args.get("dp_kernel") or "dense"),
        local_size=_local_size(),
        world_size=dist.get_world_size(),
    )
    model = DistributedModelParallel(
        _Wrapper(module),
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[EmbeddingBagCollectionSharder()],
    )
    dense = [p for p in model.parameters() if p.requires_grad]
    dense_optimizer = _dense_optimizer(args, "shardkit")(dense, lr=LR) if dense else None
    keys = [f"f{i}" for i in range(args["tables"])]
    return (
        model,
        _Optimizers(dense_optimizer, model.fused_optimizer),
        lambda v, n: KeyedJaggedTensor(keys, v, lengths=n),
    )


class _Wrapper(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, features):
        return self.ebc(features)


class _Optimizers:
    def __init__(self, *optimizers) -> None:
        self._optimizers = [o for o in optimizers if o is not None]

    def zero_grad(self) -> None:
        for optimizer in self._optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self._optimizers:
            optimizer.step()


def _dense_optimizer(args: Dict[str, Any], lib: str):
    """The optimizer of data-parallel (dense) tables: torch.optim's; each library's own row-wise Adagrad."""
    if args["optimizer"] == "rowwise_adagrad":
        if lib == "torchrec":
            from torchrec.optim import RowWiseAdagrad
        else:
            from shardkit.optim import RowWiseAdagrad
        return RowWiseAdagrad
    return {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[args["optimizer"]]


def _local_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def _generators(
    kind: str, lib: str, tables: int, kernel: Optional[str] = None, dp_kernel: str = "dense"
) -> Dict[str, Any]:
    if lib == "torchrec":
        from torchrec.distributed import sharding_plan as plans
    else:
        from shardkit.sharding import sharding_plan as plans
    world = dist.get_world_size()
    extra = {} if kernel is None else {"compute_kernel": kernel}
    make = {
        "table_wise": lambda i: plans.table_wise(rank=i % world, **extra),
        "row_wise": lambda i: plans.row_wise(**extra),
        "column_wise": lambda i: plans.column_wise(ranks=list(range(world)), **extra),
        # torchrec's table_row_wise takes no kernel (set to FUSED in _build_torchrec)
        "table_row_wise": lambda i: plans.table_row_wise(host_index=i % (world // _local_size())),
        # DENSE in both libraries (torchrec's only data-parallel kernel; shardkit's default for a fused
        # collection is FUSED since issue 23), each trained by the same torch.optim optimizer
        "data_parallel": lambda i: plans.data_parallel(
            **({} if lib == "torchrec" else {"compute_kernel": dp_kernel})
        ),
        "grid_shard": lambda i: plans.grid_shard(host_indexes=list(range(world // _local_size()))),
    }[kind]
    return {f"t{i}": make(i) for i in range(tables)}


def prepare(lib: str, kind: str, args: Dict[str, Any], tables: Dict[str, torch.Tensor], raw: List[tuple]):
    """Build ``lib``'s sharded model with ``tables``' weights; ``(step, fwd_max_abs_diff)`` where
    ``step(i)`` runs one training step on batch ``i % len(raw)`` of this rank."""
    model, optimizer, make_kjt = (_build_torchrec if lib == "torchrec" else _build_shardkit)(args, kind)
    features = [make_kjt(v, n) for v, n in raw]
    _load_tables(model.state_dict(), tables)
    with torch.no_grad():
        out = model(features[0])
        out = out.wait() if hasattr(out, "wait") else out
        pooled = out.to_dict()
    expected = _reference(args, tables, *raw[0])
    diff = max(float((pooled[f"f{i}"] - expected[i]).abs().max()) for i in range(args["tables"]))

    def step(i: int) -> None:
        optimizer.zero_grad()
        out = model(features[i % len(features)])
        out = out.wait() if hasattr(out, "wait") else out
        out.values().pow(2).mean().backward()
        optimizer.step()

    return step, diff


def timed(step, iters: int) -> tuple:
    """Run ``iters`` steps between barriers: ``(slowest rank's wall s, busiest rank's main-thread CPU s)``."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    for i in range(iters):
        step(i)
    cpu = time.thread_time() - cpu
    dist.barrier()
    wall = time.perf_counter() - wall
    both = torch.tensor([wall, cpu], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return float(both[0]), float(both[1])


def step_worker(lib: str, kind: str, args: Dict[str, Any]) -> Dict[str, float]:
    """Build ``lib``'s sharded model, check its forward, time ``args['iters']`` training steps."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    raw = _batches(args, dist.get_rank())
    tables = _full_tables(args)
    step, diff = prepare(lib, kind, args, tables, raw)
    del tables
    for i in range(args["warmup"]):
        step(i)
    wall, cpu = timed(step, args["iters"])
    diffs: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, diff)
    return {
        "steps_per_s": args["iters"] / wall,
        "cpu_ms_per_step": 1e3 * cpu / args["iters"],
        "fwd_max_abs_diff": max(diffs),
    }


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument(
        "--dims",
        type=int,
        nargs="+",
        help="several widths: table i gets dims[i %% len(dims)]",
    )
    parser.add_argument("--batch", type=int, default=2048, help="samples per rank")
    parser.add_argument("--pooling", type=int, default=20, help="mean ids per bag")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternate the libraries this many times")
    parser.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    parser.add_argument("--types", nargs="+", default=SHARDING_TYPES, choices=SHARDING_TYPES + OPTIONAL_TYPES)
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="the grid of shapes instead (benchmarks.vs_torchrec_sweep; its options follow, e.g. --quick)",
    )
    args_list = sys.argv[1:] if argv is None else list(argv)
    if "--sweep" in args_list:
        from benchmarks.vs_torchrec_sweep import main as sweep_main

        sweep_main([a for a in args_list if a != "--sweep"])
        return
    parsed = parser.parse_args(argv)
    if handled_without_peers("vs_torchrec", argv, parsed.out):
        return
    from benchmarks.vs_torchrec import step_worker as worker  # workers unpickle it by module name
    from shardkit.testing import run_world

    args = {k: v for k, v in vars(parsed).items() if k not in ("out", "types")}
    rows = []
    for kind in parsed.types:
        best: Dict[str, Dict[str, float]] = {}
        for round_index in range(parsed.rounds):
            order = ("torchrec", "shardkit") if round_index % 2 == 0 else ("shardkit", "torchrec")
            for lib in order:
                local = 1 if kind == "grid_shard" else None  # one rank per node: a block per node
                result = run_world(
                    worker, parsed.world, lib, kind, args, timeout=900, local_world_size=local
                )[0]
                if lib not in best or result["steps_per_s"] > best[lib]["steps_per_s"]:
                    best[lib] = result
        shardkit, torchrec = best["shardkit"], best["torchrec"]
        rows.append(
            {
                "name": kind,
                "torchrec_steps_per_s": torchrec["steps_per_s"],
                "shardkit_steps_per_s": shardkit["steps_per_s"],
                "ratio_wall": shardkit["steps_per_s"] / torchrec["steps_per_s"],
                "torchrec_cpu_ms": torchrec["cpu_ms_per_step"],
                "shardkit_cpu_ms": shardkit["cpu_ms_per_step"],
                "ratio_cpu": torchrec["cpu_ms_per_step"] / shardkit["cpu_ms_per_step"],
                "torchrec_fwd_diff": torchrec["fwd_max_abs_diff"],
                "shardkit_fwd_diff": shardkit["fwd_max_abs_diff"],
            }
        )
    config = {**args, "types": parsed.types, "backend": "gloo", "threads_per_rank": 1}
    write_results("vs_torchrec", config, rows, parsed.out)


if __name__ == "__main__":
    main()
