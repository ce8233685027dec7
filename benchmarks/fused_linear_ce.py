"""Fused linear cross-entropy against the unfused loss: time AND peak memory of forward + backward, per row.

One row per (dtype, tp): ``hidden [T, H] @ weight_shard [V/tp, H].T`` then the vocab-parallel
cross-entropy (mean over the tokens), both gradients, computed two ways:

- ``unfused``: the logits materialized (``hidden @ weight_shard.t()``), then
  ``vocab_parallel_cross_entropy`` (autograd through the matmul);
- ``fused``: ``vocab_parallel_linear_cross_entropy(hidden, weight_shard, labels)`` (logits never whole);
- ``fused_baseline`` (only with ``--baseline REV``): the same function as of git revision ``REV`` of this
  checkout (its ``losses/fused_linear.py`` with its ``losses/statistics.py``, which sets the block
  sizes; the rest of the library is the current one), to measure a change before / after in one run.

Time: the first variant's fresh processes (one per rank, gloo) run an untimed warm-up step of every
variant, then ``--rounds`` rounds that alternate the variants step by step; per step, the CPU time
(user + system) of the slowest rank, and the wall time. ``time_ratio`` is the median over rounds of
``fused / unfused`` within a round (paired, so that the load of a shared machine hits both alike).

Peak memory: every variant runs its first step in fresh processes, where each rank resets the kernel's
high-water mark (``/proc/self/clear_refs`` = 5) and reads its RSS right before the step, then reads
``VmHWM`` after it; the peak is the largest ``VmHWM - RSS before`` over the ranks (what the step touched
on top of its inputs, allocator caching included; a step of 8 tokens before it keeps one-time library
initialization out). CUDA: ``max_memory_allocated``. In MiB and in units
of one ``[T, V/tp]`` tensor of the dtype.

Usage: ``python benchmarks/fused_linear_ce.py [--tokens 4096 --vocab 128000 --hidden 256 --tp 2 1
--dtypes bf16 fp32 --rounds 2]`` (about 2.5 minutes on an idle 2-core machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_results  # noqa: E402
from benchmarks.vocab_parallel_ce import DTYPES, PeakMemory, _free_port  # noqa: E402
from shardkit.losses import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy  # noqa: E402


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _fused_function(cfg, variant):
    if variant == "fused":
        return vocab_parallel_linear_cross_entropy
    # the baseline revision's fused_linear.py, using that revision's statistics.py (its block sizes)
    statistics = _load("baseline_statistics", Path(cfg["baseline"], "statistics.py"))
    module = _load("baseline_fused_linear", Path(cfg["baseline"], "fused_linear.py"))
    module.st = statistics
    return module.vocab_parallel_linear_cross_entropy


def _baseline_files(revision, directory):
    """``losses/fused_linear.py`` and ``losses/statistics.py`` of a git revision, written to ``directory``."""
    root = Path(__file__).resolve().parent.parent
    for name in ("fused_linear.py", "statistics.py"):
        text = subprocess.run(
            ["git", "show", f"{revision}:src/shardkit/losses/{name}"],
            cwd=root, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        Path(directory, name).write_text(text)
    return directory


def _inputs(cfg, rank, device):
    """This rank's ``hidden`` (the same on every rank), weight rows and targets, made in their dtype."""
    dtype = DTYPES[cfg["dtype"]]
    gen = torch.Generator(device=device).manual_seed(1234)
    width = cfg["vocab"] // cfg["tp"]
    hidden = torch.empty(cfg["tokens"], cfg["hidden"], dtype=dtype, device=device).normal_(generator=gen)
    target = torch.randint(0, cfg["vocab"], (cfg["tokens"],), generator=gen, device=device)
    w_gen = torch.Generator(device=device).manual_seed(7 + rank)
    weight = torch.empty(width, cfg["hidden"], dtype=dtype, device=device)
    weight.normal_(std=cfg["hidden"] ** -0.5, generator=w_gen)
    return hidden.requires_grad_(), weight.requires_grad_(), target


def _stepper(cfg, variant, x):
    """``step()``: one forward + backward of ``variant``; returns the loss value."""
    hidden, weight, target = x
    fused = None if variant == "unfused" else _fused_function(cfg, variant)

    def step():
        if fused is None:
            loss = vocab_parallel_cross_entropy(hidden @ weight.t(), target, reduction="mean")
        else:
            loss = fused(hidden, weight, target, reduction="mean", chunk_size=cfg["chunk_size"])
        loss.backward()
        hidden.grad = weight.grad = None  # freed inside the step, as a training step's optimizer would
        return float(loss.detach())

    return step


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _worker(rank, variant, timed, cfg, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=cfg["tp"])
    try:
        # one step of 8 tokens first: one-time initialization (the native kernels' library, oneDNN's
        # code) is then not counted as the variant's memory
        _stepper(cfg, variant, _inputs({**cfg, "tokens": 8}, rank, device))()
        x = _inputs(cfg, rank, device)
        steps = {v: _stepper(cfg, v, x) for v in (cfg["variants"] if timed else [variant])}
        dist.barrier()
        meter = PeakMemory(device)
        meter.start()
        loss = steps[variant]()  # the measured step of a fresh process, also this variant's warm-up
        result = {"peak": meter.peak(), "loss": loss, "cpu": {}, "wall": {}}
        if timed:
            for v in cfg["variants"]:
                if v != variant:
                    steps[v]()  # warm-up
            for v in cfg["variants"]:
                result["cpu"][v], result["wall"][v] = [], []
            for _ in range(cfg["rounds"]):
                for v in cfg["variants"]:
                    dist.barrier()
                    _sync(device)
                    wall0, cpu0 = time.perf_counter(), _cpu_seconds()
                    steps[v]()
                    _sync(device)
                    # this rank's CPU time (user + system): on a loaded machine the wall time also
                    # counts other processes' turns, this does not
                    result["cpu"][v].append(_cpu_seconds() - cpu0)
                    dist.barrier()  # the slowest rank ends the step
                    result["wall"][v].append(time.perf_counter() - wall0)
        Path(out_dir, f"{variant}.{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _median(values):
    return statistics.median(values)  # of 2 rounds: their mean


def _measure(cfg, out_dir):
    """Run every variant's fresh processes; returns ``{variant: [per-rank result]}``."""
    results = {}
    for i, variant in enumerate(cfg["variants"]):
        args = (variant, i == 0, cfg, _free_port(), out_dir)
        mp.spawn(_worker, args=args, nprocs=cfg["tp"], join=True)
        paths = [Path(out_dir, f"{variant}.{r}.json") for r in range(cfg["tp"])]
        results[variant] = [json.loads(path.read_text()) for path in paths]
    return results


def _row(cfg, results):
    """One table row: both (all) variants' times and peaks, and the fused / unfused ratios."""
    timed = results[cfg["variants"][0]]
    unit = cfg["tokens"] * (cfg["vocab"] // cfg["tp"]) * DTYPES[cfg["dtype"]].itemsize
    row = {"name": f"{cfg['dtype']} tp={cfg['tp']}"}
    per_round = {}
    for v in cfg["variants"]:
        # per round, the slowest rank's CPU time and the step's wall time
        per_round[v] = [max(r["cpu"][v][k] for r in timed) for k in range(cfg["rounds"])]
        row[f"{v}_cpu_s"] = _median(per_round[v])
        row[f"{v}_wall_s"] = _median([max(r["wall"][v][k] for r in timed) for k in range(cfg["rounds"])])
    for v in cfg["variants"]:
        peak = max(r["peak"] for r in results[v])
        row[f"{v}_peak_mib"] = peak / 2**20
        row[f"{v}_peak_units"] = peak / unit
    for v in cfg["variants"][1:]:
        row[f"{v}/unfused_cpu"] = _median([a / b for a, b in zip(per_round[v], per_round["unfused"])])
        row[f"{v}/unfused_peak"] = row[f"{v}_peak_mib"] / row["unfused_peak_mib"]
        row[f"{v}_loss_diff"] = abs(results[v][0]["loss"] - results["unfused"][0]["loss"])
    return row, per_round


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 1])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (each runs every variant once)")
    p.add_argument("--chunk-size", type=int, default=None, help="the fused loss's chunk_size")
    p.add_argument("--baseline", metavar="REV", default=None, help="a git revision's fused loss, timed too")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    for tp in args.tp:
        if args.vocab % tp:
            p.error(f"--vocab {args.vocab} must be divisible by every --tp, not by {tp}")
        if args.device.startswith("cuda") and tp > torch.cuda.device_count():
            p.error(f"--tp {tp} needs as many GPUs, found {torch.cuda.device_count()}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    variants = ["unfused", "fused"] + (["fused_baseline"] if args.baseline else [])
    rows, rounds, started = [], {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir, tempfile.TemporaryDirectory() as baseline_dir:
        try:
            baseline = None if args.baseline is None else _baseline_files(args.baseline, baseline_dir)
        except subprocess.CalledProcessError as e:
            p.error(f"--baseline {args.baseline}: {e.stderr.strip()}")
        for dtype in args.dtypes:
            for tp in args.tp:
                cfg = {
                    "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "tp": tp,
                    "dtype": dtype, "rounds": args.rounds, "chunk_size": args.chunk_size,
                    "baseline": baseline,
                    "device": args.device, "variants": variants,
                    "threads": max(1, (os.cpu_count() or 1) // tp),
                }  # fmt: skip
                row, rounds[f"{dtype} tp={tp}"] = _row(cfg, _measure(cfg, out_dir))
                rows.append(row)
                print(f"done: {rows[-1]['name']}", file=sys.stderr)
    config = {
        "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "tp": args.tp,
        "dtypes": args.dtypes, "rounds": args.rounds, "chunk_size": args.chunk_size,
        "baseline": args.baseline,
        "variants": variants, "seconds": time.perf_counter() - started, "rounds_cpu_s": rounds,
        "time": "median over rounds of the slowest rank's CPU time per step; ratios paired per round",
        "memory": "CPU: per-rank VmHWM - VmRSS around the first full step of fresh processes; "
        "CUDA: max_memory_allocated",
    }  # fmt: skip
    write_results("fused_linear_ce", config, rows, args.out)


if __name__ == "__main__":
    main()
