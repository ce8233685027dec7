"""Vocab-parallel cross-entropy: time and peak memory of forward + backward, shardkit vs the naive way.

Rows (each at ``--tp`` ranks, the vocabulary split evenly, mean loss over ``--tokens`` tokens):

- ``naive``: all-gather the logits shards (``shardkit.distributed.gather_from_region``), then
  ``F.cross_entropy`` on the full ``[T, V]`` logits;
- ``shardkit_ce``: ``vocab_parallel_cross_entropy`` on the ``[T, V/tp]`` shard;
- ``linear+shardkit_ce``: ``hidden @ weight_shard.T`` materialized, then ``shardkit_ce`` (the unfused
  baseline of the next row: it includes the matmuls);
- ``shardkit_fused_linear_ce``: ``vocab_parallel_linear_cross_entropy(hidden, weight_shard)``.

Peak memory, CPU: every row runs in fresh processes (one per rank, gloo). Right before the measured
forward + backward, each rank resets the kernel's peak-RSS counter (``/proc/self/clear_refs`` = 5) and
reads its RSS; afterwards it reads ``VmHWM`` (the kernel's high-water mark of resident memory). The
row's peak is the largest ``VmHWM - RSS before`` over the ranks: every byte the step touched on top of
its inputs, as the kernel counted it (allocator caching included, so it can only overstate). CUDA:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the memory in use before.
Memory is also given in units of one ``[T, V/tp]`` tensor of the input dtype.

Usage: ``python benchmarks/vocab_parallel_ce.py [--tokens 4096 --vocab 128000 --tp 2 --hidden 256
--dtype bf16 --repeats 3]``. On CUDA (``--device cuda``) one GPU runs ``--tp 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_seconds, write_results  # noqa: E402
from shardkit.distributed import gather_from_region  # noqa: E402
from shardkit.losses import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy  # noqa: E402

VARIANTS = ("naive", "shardkit_ce", "linear+shardkit_ce", "shardkit_fused_linear_ce")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


class PeakMemory:
    """Bytes touched on top of what was resident at ``start()``, by the kernel's (or CUDA's) count."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.base = _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status_kib("VmHWM") * 1024 - self.base


def _inputs(variant, cfg, rank, device):
    """Inputs made in place in their own dtype (no full-size fp32 temporaries that would raise the peak)."""
    dtype = DTYPES[cfg["dtype"]]
    gen = torch.Generator(device=device).manual_seed(1234)
    tokens, width, hidden = cfg["tokens"], cfg["vocab"] // cfg["tp"], cfg["hidden"]
    target = torch.randint(0, cfg["vocab"], (tokens,), generator=gen, device=device)
    if variant in ("naive", "shardkit_ce"):
        full_gen = torch.Generator(device=device).manual_seed(99 + rank)
        logits = torch.empty(tokens, width, dtype=dtype, device=device).normal_(generator=full_gen)
        return {"logits": logits.requires_grad_(), "target": target}
    h = torch.empty(tokens, hidden, dtype=dtype, device=device).normal_(generator=gen)
    w_gen = torch.Generator(device=device).manual_seed(7 + rank)
    w = torch.empty(width, hidden, dtype=dtype, device=device).normal_(std=hidden**-0.5, generator=w_gen)
    return {"hidden": h.requires_grad_(), "weight": w.requires_grad_(), "target": target}


def _step(variant, x):
    """One forward + backward; returns the loss value."""
    if variant == "naive":
        full = gather_from_region(x["logits"], -1)
        loss = F.cross_entropy(full, x["target"])
    elif variant == "shardkit_ce":
        loss = vocab_parallel_cross_entropy(x["logits"], x["target"], reduction="mean")
    elif variant == "linear+shardkit_ce":
        logits = x["hidden"] @ x["weight"].t()
        loss = vocab_parallel_cross_entropy(logits, x["target"], reduction="mean")
    else:
        loss = vocab_parallel_linear_cross_entropy(x["hidden"], x["weight"], x["target"], reduction="mean")
    loss.backward()
    for t in x.values():
        t.grad = None
    return float(loss.detach())


def _worker(rank, variant, cfg, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=cfg["tp"])
    try:
        x = _inputs(variant, cfg, rank, device)
        dist.barrier()
        meter = PeakMemory(device)
        meter.start()
        loss = _step(variant, x)  # the measured step, which is also the warm-up
        peak = meter.peak()
        dist.barrier()
        step = lambda: (_step(variant, x), dist.barrier())  # noqa: E731
        seconds = median_seconds(step, repeats=cfg["repeats"], warmup=0)
        result = {"peak": peak, "s": seconds, "loss": loss}
        Path(out_dir, f"{variant}.{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128000)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the fused linear rows")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.vocab % args.tp:
        p.error(f"--vocab {args.vocab} must be divisible by --tp {args.tp}")
    if args.device.startswith("cuda") and args.tp > torch.cuda.device_count():
        p.error(f"--tp {args.tp} needs as many GPUs, found {torch.cuda.device_count()}")
    cfg = {
        "tokens": args.tokens,
        "vocab": args.vocab,
        "tp": args.tp,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "device": args.device,
        "threads": max(1, (os.cpu_count() or 1) // args.tp),
        "memory": "CPU: per-rank VmHWM - VmRSS around one step (fresh processes); CUDA: max_memory_allocated",
    }
    unit = args.tokens * (args.vocab // args.tp) * DTYPES[args.dtype].itemsize
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for variant in args.variants:
            mp.spawn(_worker, args=(variant, cfg, _free_port(), out_dir), nprocs=args.tp, join=True)
            per_rank = [json.loads(Path(out_dir, f"{variant}.{r}.json").read_text()) for r in range(args.tp)]
            peak = max(r["peak"] for r in per_rank)
            rows.append(
                {
                    "name": variant,
                    "time_s": max(r["s"] for r in per_rank),
                    "peak_mib": peak / 2**20,
                    "peak_units": peak / unit,
                    "loss": per_rank[0]["loss"],
                }
            )
            print(f"done: {variant}", file=sys.stderr)
    naive = next((r for r in rows if r["name"] == "naive"), None)
    for row in rows:
        if naive is not None:
            row["time_vs_naive"] = row["time_s"] / naive["time_s"]
            row["peak_vs_naive"] = row["peak_mib"] / naive["peak_mib"]
    cfg["unit"] = f"one [T, V/tp] {args.dtype} tensor = {unit / 2**20:.1f} MiB"
    write_results("vocab_parallel_ce", cfg, rows, args.out)


if __name__ == "__main__":
    main()
