"""Vocab-parallel cross-entropy: time and peak memory of forward + backward, shardkit vs the naive way.

Rows (each at ``--tp`` ranks, the vocabulary split evenly, mean loss over ``--tokens`` tokens):

- ``naive``: all-gather the logits shards (``shardkit.distributed.gather_from_region``), then
  ``F.cross_entropy`` on the full ``[T, V]`` logits;
- ``shardkit_ce``: ``vocab_parallel_cross_entropy`` on the ``[T, V/tp]`` shard;
- ``linear+shardkit_ce``: ``hidden @ weight_shard.T`` materialized, then ``shardkit_ce`` (the unfused
  baseline of the next row: it includes the matmuls);
- ``shardkit_fused_linear_ce``: ``vocab_parallel_linear_cross_entropy(hidden, weight_shard)``;
- ``logprobs_one_block``: next-token log-probs (``from_parallel_logits_to_logprobs``) of ``[1, T, V/tp]``
  with ``chunk_size=T``, which allows one fp32 work block of ``[T, V/tp]`` (the kernels use cache-sized
  blocks within that bound anyway);
- ``logprobs_chunked``: ``ChunkedDistributedLogprob`` with ``--chunk`` positions per block;
- ``logprobs_cp``: ``from_parallel_logits_to_logprobs(..., cp_group=)`` on ``--tp`` x ``--cp`` ranks, each
  holding ``[1, T/cp, V/tp]`` (load-balanced halves); ``tp * cp`` processes share the machine, so its
  time is not comparable with the ``tp``-process rows on a machine with fewer cores than that.

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
import resource
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
from shardkit.losses import (  # noqa: E402
    ChunkedDistributedLogprob,
    from_parallel_logits_to_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)
from shardkit.losses.context_parallel import context_parallel_positions  # noqa: E402

VARIANTS = (
    "naive",
    "shardkit_ce",
    "linear+shardkit_ce",
    "shardkit_fused_linear_ce",
    "logprobs_one_block",
    "logprobs_chunked",
    "logprobs_cp",
)
LOGPROB_VARIANTS = ("logprobs_one_block", "logprobs_chunked", "logprobs_cp")
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


def _groups(variant, cfg, rank):
    """``(tp_group, tp_rank, cp_group, cp_rank, cp)``: ranks laid out as ``arange(world).reshape(cp, tp)``."""
    tp = cfg["tp"]
    cp = cfg["cp"] if variant == "logprobs_cp" else 1
    if cp == 1:
        return None, rank, None, 0, 1
    table = torch.arange(tp * cp).reshape(cp, tp)
    tp_groups = [dist.new_group(row.tolist()) for row in table]
    cp_groups = [dist.new_group(col.tolist()) for col in table.t()]
    cp_rank, tp_rank = divmod(rank, tp)
    return tp_groups[cp_rank], tp_rank, cp_groups[tp_rank], cp_rank, cp


def _inputs(variant, cfg, rank, device):
    """Inputs made in place in their own dtype (no full-size fp32 temporaries that would raise the peak)."""
    dtype = DTYPES[cfg["dtype"]]
    gen = torch.Generator(device=device).manual_seed(1234)
    tokens, width, hidden = cfg["tokens"], cfg["vocab"] // cfg["tp"], cfg["hidden"]
    target = torch.randint(0, cfg["vocab"], (tokens,), generator=gen, device=device)
    if variant in LOGPROB_VARIANTS:
        tp_group, tp_rank, cp_group, cp_rank, cp = _groups(variant, cfg, rank)
        positions = context_parallel_positions([(0, tokens)], cp, cp_rank, device)
        full_gen = torch.Generator(device=device).manual_seed(99 + tp_rank)
        # the same logits at every cp size: this rank's positions of the full sequence (made before the
        # measurement starts, so the temporary does not count)
        logits = torch.empty(1, tokens, width, dtype=dtype, device=device).normal_(generator=full_gen)
        if cp > 1:
            logits = logits.index_select(1, positions)
        return {
            "logits": logits.requires_grad_(),
            "target": target.view(1, tokens),
            "groups": (tp_group, cp_group),
            "slice": (tp_rank * width, (tp_rank + 1) * width),
            "chunk": cfg["chunk"],
        }
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
    elif variant == "shardkit_fused_linear_ce":
        loss = vocab_parallel_linear_cross_entropy(x["hidden"], x["weight"], x["target"], reduction="mean")
    else:
        (tp_group, cp_group), (start, end) = x["groups"], x["slice"]
        logits, target = x["logits"], x["target"]
        if variant == "logprobs_chunked":
            shifted = target.roll(-1, dims=-1)  # the Function takes already shifted targets
            loss = ChunkedDistributedLogprob.apply(logits, shifted, start, end, x["chunk"], tp_group)[:, :-1]
        else:
            chunk = target.shape[-1] if variant == "logprobs_one_block" else None
            loss = from_parallel_logits_to_logprobs(
                logits, target, start, end, tp_group, False, cp_group, chunk_size=chunk
            )
        loss = -loss.mean()
    loss.backward()
    for t in x.values():
        if isinstance(t, torch.Tensor):
            t.grad = None
    return float(loss.detach())


def _worker(rank, variant, cfg, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    world = cfg["tp"] * (cfg["cp"] if variant == "logprobs_cp" else 1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        x = _inputs(variant, cfg, rank, device)
        dist.barrier()
        meter = PeakMemory(device)
        meter.start()
        loss = _step(variant, x)  # the measured step, which is also the warm-up
        peak = meter.peak()
        dist.barrier()
        step = lambda: (_step(variant, x), dist.barrier())  # noqa: E731
        cpu0 = _cpu_seconds()
        seconds = median_seconds(step, repeats=cfg["repeats"], warmup=0)
        # CPU time of this rank per step (user + system, the barrier's wait excluded): on a shared,
        # loaded machine the wall time also counts the other processes' turns, this does not
        cpu = (_cpu_seconds() - cpu0) / cfg["repeats"]
        result = {"peak": peak, "s": seconds, "cpu_s": cpu, "loss": loss}
        Path(out_dir, f"{variant}.{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
    p.add_argument("--cp", type=int, default=2, help="context-parallel size of the logprobs_cp row")
    p.add_argument("--chunk", type=int, default=256, help="positions per block of the logprobs_chunked row")
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
        "cp": args.cp,
        "chunk": args.chunk,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "device": args.device,
        "threads": max(1, (os.cpu_count() or 1) // args.tp),
        # the logprobs_cp row runs tp * cp processes with the same thread count each
        "memory": "CPU: per-rank VmHWM - VmRSS around one step (fresh processes); CUDA: max_memory_allocated",
    }
    unit = args.tokens * (args.vocab // args.tp) * DTYPES[args.dtype].itemsize
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for variant in args.variants:
            nprocs = args.tp * (args.cp if variant == "logprobs_cp" else 1)
            mp.spawn(_worker, args=(variant, cfg, _free_port(), out_dir), nprocs=nprocs, join=True)
            per_rank = [json.loads(Path(out_dir, f"{variant}.{r}.json").read_text()) for r in range(nprocs)]
            peak = max(r["peak"] for r in per_rank)
            rows.append(
                {
                    "name": variant,
                    "time_s": max(r["s"] for r in per_rank),
                    "cpu_s": max(r["cpu_s"] for r in per_rank),
                    "peak_mib": peak / 2**20,
                    "peak_units": peak / unit,
                    "loss": per_rank[0]["loss"],
                }
            )
            print(f"done: {variant}", file=sys.stderr)
    naive = next((r for r in rows if r["name"] == "naive"), None)
    one_block = next((r for r in rows if r["name"] == "logprobs_one_block"), None)
    for row in rows:
        if naive is not None and row["name"] not in LOGPROB_VARIANTS:
            row["time_vs_naive"] = row["time_s"] / naive["time_s"]
            row["peak_vs_naive"] = row["peak_mib"] / naive["peak_mib"]
        if one_block is not None and row["name"] in LOGPROB_VARIANTS:
            row["time_vs_one_block"] = row["time_s"] / one_block["time_s"]
            row["peak_vs_one_block"] = row["peak_mib"] / one_block["peak_mib"]
    cfg["unit"] = f"one [T, V/tp] {args.dtype} tensor = {unit / 2**20:.1f} MiB"
    write_results("vocab_parallel_ce", cfg, rows, args.out)


if __name__ == "__main__":
    main()
