#!/usr/bin/env python
"""Does the CE's speed against Megatron hinge on this CPU's cache sizes? (issue 28 item 4)

The CPU cross-entropy takes its block sizes from the machine's caches (``shardkit.kernels.cpu_cache``).
This runs the vocab-parallel cross-entropy fwd + bwd with the block sizes the choice rule gives for
several *emulated* cache sizes (``SHARDKIT_CPU_CACHES``, set per call in each rank, then the cached
sizes re-read), next to Megatron-core's ``vocab_parallel_cross_entropy`` on the same shard, in the
same processes, the methods alternated round by round. It shows whether the *choice* matters: the
hardware underneath stays this machine's (what a smaller real L2 does to the kernels' memory traffic
is what ``valgrind --tool=cachegrind`` can simulate; see docs/performance.md).

What each emulated size changes on the native path (fp32 / bf16, the issue's case): the statistics
chunk, half the L1d in columns (``columns_in_cache``); the L2 picks only the pure-torch path's rows
(fp16, soft-capping, ``SHARDKIT_NATIVE=0``), printed as ``torch rows`` but not run here. Emulated
sizes with the same chunk run the same code: their spread is the run's noise. Two sizes no CPU has
(an 8 KiB and a 1 MiB L1d: chunks of 1024 columns and the whole row) show what a wrong detection
would cost.

Run with the Megatron peer venv, this checkout first on the path (3.6-4.3 minutes at the defaults on
the 2-core VM with a load average of 13-30; ``--quick``: 2 rounds, 4 sizes, about half that)::

    PYTHONPATH=src:. $HOME/peers/megatron/bin/python benchmarks/ce_cache_sensitivity.py
    PYTHONPATH=src:. $HOME/peers/megatron/bin/python benchmarks/ce_cache_sensitivity.py --quick

Timing as ``../shared/peers/vs_megatron_ce.py``: each iteration a fresh copy of the shard (outside the
timed region), ``loss.mean()`` forward and backward, barrier-synchronised, the slowest rank; per method
the round with the least fwd + bwd (the order of the methods rotates by one each round). ``vs_megatron``:
Megatron's fwd + bwd / this row's (above 1: faster); ``bwd_over_megatron``: this row's backward time over
Megatron's (below 1: faster). ``cpu_*``: the same from each rank's process CPU time (user + system,
the barriers' waits excluded; the slowest rank per round): on a loaded machine the wall time also
counts other processes' turns. ``loss_diff`` / ``grad_diff``: max abs difference from Megatron's loss
and gradient on the first (warm-up) call. Without megatron-core importable (this checkout's own venv,
``./dev bench``) only shardkit's rows run, their values checked against the first emulated size's.
Results: a table and ``--out DIR/ce_cache_sensitivity.json`` (``benchmarks/common.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# run as a script, the checkout's root is not on the path: benchmarks.common needs it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_results  # noqa: E402
from shardkit.kernels import cpu_cache  # noqa: E402
from shardkit.losses import statistics as st  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (L1d, L2) per core: AMD Zen 2/3 EPYC; Zen 4 EPYC / Skylake-SP Xeon (also the detection's fallback);
# this machine (Sapphire Rapids-class Xeon); then two sizes no x86 CPU has, standing for a wrong detection
DEFAULT_CACHES = "32K/256K,32K/512K,32K/1M,48K/2M,8K/2M,1M/32M"
# --quick: two sizes with the same chunk (their spread is the noise), this machine's, the whole row
QUICK_CACHES = "32K/512K,32K/1M,48K/2M,1M/32M"


def _caches(text: str) -> List[str]:
    specs = [c.strip() for c in text.split(",") if c.strip()]
    for spec in specs:
        l1d, _, l2 = spec.partition("/")
        cpu_cache.override_sizes(f"l1d={l1d},l2={l2}")  # raises, naming the bad part
    return specs


def emulate(spec: Optional[str]) -> cpu_cache.CacheSizes:
    """Make this process's CE see the ``"L1D/L2"`` cache sizes (None: the detected ones)."""
    if spec is None:
        os.environ.pop(cpu_cache.OVERRIDE_ENV, None)
    else:
        l1d, _, l2 = spec.partition("/")
        os.environ[cpu_cache.OVERRIDE_ENV] = f"l1d={l1d},l2={l2}"
    cpu_cache.cache_sizes.cache_clear()
    return cpu_cache.cache_sizes()


def worker(rank, args, port, q):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    from shardkit.distributed.validation import set_validation
    from shardkit.losses import vocab_parallel_cross_entropy as sk_ce

    if args.megatron:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.world_size)
    set_validation(False)

    def shardkit_ce(x, t):
        return sk_ce(x, t, group=dist.group.WORLD)

    ws, width = args.world_size, args.vocab // args.world_size
    out = {}
    for dname in args.dtypes:
        gen = torch.Generator().manual_seed(100 + rank)
        shard = (torch.randn(args.tokens, width, generator=gen) * 2.0).to(DTYPES[dname])
        target = torch.randint(0, width * ws, (args.tokens,), generator=torch.Generator().manual_seed(0))
        # the first method is the reference of the values check
        methods = {**({"megatron": None} if args.megatron else {}), **{spec: spec for spec in args.caches}}
        first = next(iter(methods))
        times = {m: [] for m in methods}
        cpu = {m: [] for m in methods}
        info = {}
        ref_loss = ref_grad = None
        order = list(methods)
        for it in range(1 + args.rounds):
            # each round starts one method later: no method always runs right after the same other one
            for m in order[it % len(order) :] + order[: it % len(order)]:
                spec = methods[m]
                if spec is not None:
                    sizes = emulate(spec)
                    chunk = cpu_cache.columns_in_cache(shard.element_size(), sizes.l1d)
                    torch_rows = st.cache_rows(width, 1 << 30, shard.device, shard.element_size())
                    info.setdefault(m, {}).update(chunk=min(chunk, width), torch_rows=torch_rows)
                fn = vocab_parallel_cross_entropy if spec is None else shardkit_ce
                x = shard.clone().requires_grad_(True)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                loss = fn(x, target)
                mean = loss.mean()
                c1 = time.process_time()
                dist.barrier()
                t1 = time.perf_counter()
                c1b = time.process_time()
                mean.backward()
                c2 = time.process_time()
                dist.barrier()
                t2 = time.perf_counter()
                if it == 0:  # warm-up: the check against the reference's values (it runs first)
                    if m == first:
                        ref_loss, ref_grad = loss.detach().float(), x.grad.float()
                    if spec is not None:
                        info[m]["loss_diff"] = (loss.detach().float() - ref_loss).abs().max().item()
                        info[m]["grad_diff"] = (x.grad.float() - ref_grad).abs().max().item()
                else:
                    times[m].append((t1 - t0, t2 - t1))
                    cpu[m].append((c1 - c0, c2 - c1b))
                del x, loss, mean
            if it == 0:
                del ref_loss, ref_grad
        emulate(None)
        out[dname] = {"times": times, "cpu": cpu, "info": info}
        del shard
    res = [None] * ws
    dist.all_gather_object(res, out)
    if rank == 0:
        q.put(res)
    dist.barrier()
    if args.megatron:
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _slowest(res, dname, m, clock="times"):
    """Per round (fwd, bwd) of the slowest rank; the round with the least fwd + bwd."""
    rounds = zip(*(r[dname][clock][m] for r in res))
    per_round = [(max(f for f, _ in rs), max(b for _, b in rs)) for rs in rounds]
    return min(per_round, key=sum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128_000, help="full vocabulary; V / world-size per rank")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--caches", default=DEFAULT_CACHES, help="emulated L1D/L2 per core, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="directory for ce_cache_sensitivity.json")
    parser.add_argument(
        "--quick", action="store_true", help=f"--rounds 2 --caches {QUICK_CACHES} (same shape, half the time)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.caches = 2, QUICK_CACHES
    if args.vocab % args.world_size:
        parser.error(f"--vocab {args.vocab} is not divisible by --world-size {args.world_size}")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        parser.error(f"--dtypes: {bad or 'none'} (choose from {sorted(DTYPES)})")
    try:
        args.caches = _caches(args.caches)
    except ValueError as e:
        parser.error(f"--caches: {e}")
    args.megatron = importlib.util.find_spec("megatron") is not None
    if not args.megatron:
        print("megatron-core does not import here: shardkit's rows only (run it in the Megatron peer venv)")
    detected = cpu_cache.detected_cache_sizes()
    load_before = list(os.getloadavg())
    start = time.perf_counter()
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(args, free_port(), q), nprocs=args.world_size, start_method="spawn")
    res = q.get()
    print(
        f"detected caches ({detected.source}): L1d {detected.l1d >> 10} KiB, L2 {detected.l2 >> 10} KiB; "
        f"torch {torch.__version__}; [{args.tokens}, {args.vocab // args.world_size}] per rank, "
        f"{args.world_size} ranks x {args.threads} thread(s), {args.rounds} rounds; "
        f"{time.perf_counter() - start:.0f} s"
    )
    rows = []
    for dname in args.dtypes:
        if args.megatron:
            mf, mb = _slowest(res, dname, "megatron")
            cf, cb = _slowest(res, dname, "megatron", "cpu")
            rows.append({
                "name": f"{dname} megatron", "fwd_ms": mf * 1e3, "bwd_ms": mb * 1e3,
                "cpu_fwd_ms": cf * 1e3, "cpu_bwd_ms": cb * 1e3,
            })  # fmt: skip
        for spec in args.caches:
            f, b = _slowest(res, dname, spec)
            sf, sb = _slowest(res, dname, spec, "cpu")
            info = res[0][dname]["info"][spec]
            ratios = {}
            if args.megatron:
                ratios = {
                    "vs_megatron": (mf + mb) / (f + b), "bwd_over_megatron": b / mb,
                    "cpu_vs_megatron": (cf + cb) / (sf + sb), "cpu_bwd_over_megatron": sb / cb,
                }  # fmt: skip
            rows.append({
                "name": f"{dname} shardkit, emulated L1d/L2 {spec}", "chunk": info["chunk"],
                "torch_rows": info["torch_rows"], "fwd_ms": f * 1e3, "bwd_ms": b * 1e3,
                "cpu_fwd_ms": sf * 1e3, "cpu_bwd_ms": sb * 1e3, **ratios,
                "loss_diff": max(r[dname]["info"][spec]["loss_diff"] for r in res),
                "grad_diff": max(r[dname]["info"][spec]["grad_diff"] for r in res),
            })  # fmt: skip
    config = {
        "tokens": args.tokens, "vocab": args.vocab, "world_size": args.world_size, "threads": args.threads,
        "rounds": args.rounds, "caches": args.caches, "megatron": args.megatron,
        "detected": {"l1d": detected.l1d, "l2": detected.l2, "source": detected.source},
        "timer": "wall (barrier-synchronised) and process CPU time, slowest rank; per method the round "
        "with the least fwd+bwd; method order rotated each round",
        "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
    }  # fmt: skip
    write_results("ce_cache_sensitivity", config, rows, args.out)


if __name__ == "__main__":
    main()
