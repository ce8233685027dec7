"""Megatron-core's vocab-parallel cross-entropy against shardkit's, forward and backward apart, in CPU time.

One process, one rank's shard (``[--tokens, --width]``, the shard of ``../shared/peers/vs_megatron_ce.py``
at tp 2 by default: 4096 x 64000), a one-rank gloo group, one thread. The methods run in alternated
rounds, each on a fresh copy of the shard (Megatron's fp32 path overwrites its input), and each phase is
timed in CPU time of the process (user + system: the kernel's work of mapping a fresh gradient's pages
counts), so that the ratios hold on a loaded machine where wall time counts other processes' turns.
Methods: ``megatron``; ``shardkit`` (the default page mode, ``SHARDKIT_CE_PAGES``, and buffer timing,
``SHARDKIT_CE_GRAD_BUFFER``); ``shardkit-touch`` and ``shardkit-populate`` (the native gradient's fresh
pages faulted one 4 KiB page at a time, or mapped with one ``madvise(MADV_POPULATE_WRITE)`` per 1 MiB
of rows; both with the gradient's buffer allocated in the backward, the behaviour before the buffer
moved to the forward); ``shardkit-fwdbuf`` (populate, the buffer allocated and mapped in the forward:
the default now).

Run it with the megatron peer venv, this checkout first on the path (about 1 minute idle)::

    PYTHONPATH=src:. $HOME/peers/megatron/bin/python benchmarks/ce_backward_ab.py --dtype fp32
    PYTHONPATH=src:. $HOME/peers/megatron/bin/python benchmarks/ce_backward_ab.py --dtype bf16

Without megatron-core importable (this checkout's own venv) the ``megatron`` method is skipped with a
printed note and only the shardkit methods run (no ratios against Megatron then).
Results: the printed table and ``--out DIR/ce_backward_ab.json`` (``benchmarks/common.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import time
import warnings
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist

from benchmarks.common import write_results

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _one_rank_group() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


def _methods(names):
    from shardkit.distributed.validation import set_validation
    from shardkit.kernels.cross_entropy import BUFFER_ENV, PAGE_MODES
    from shardkit.kernels.native_build import native_ops
    from shardkit.losses import vocab_parallel_cross_entropy as sk_ce

    set_validation(False)
    ops = native_ops()

    default_timing = os.environ.get(BUFFER_ENV)

    def shardkit(mode, timing=None):
        def run(x, t):
            if mode is not None and ops is not None:
                ops.ce_fault_mode(PAGE_MODES[mode])
            if timing is None and default_timing is None:
                os.environ.pop(BUFFER_ENV, None)
            else:  # read by each call's forward
                os.environ[BUFFER_ENV] = timing or default_timing
            return sk_ce(x, t, dist.group.WORLD)

        return run

    table = {
        "shardkit": shardkit(None),
        "shardkit-touch": shardkit("touch", "backward"),
        "shardkit-populate": shardkit("populate", "backward"),
        "shardkit-fwdbuf": shardkit("populate", "forward"),
    }
    if "megatron" in names:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        table["megatron"] = vocab_parallel_cross_entropy
    return {name: table[name] for name in names}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=64000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default="megatron,shardkit-populate,shardkit-fwdbuf")
    parser.add_argument("--out", type=Path, default=None, help="directory for ce_backward_ab.json")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    known = ("megatron", "shardkit", "shardkit-touch", "shardkit-populate", "shardkit-fwdbuf")
    unknown = [m for m in methods if m not in known]
    if unknown:
        parser.error(f"unknown --methods {', '.join(unknown)}")
    if "megatron" in methods and importlib.util.find_spec("megatron") is None:
        # only the megatron peer venv has it (module docstring); the shardkit methods still compare
        print("megatron-core is not importable here: the megatron method is skipped")
        methods.remove("megatron")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    load_average = list(os.getloadavg())
    _one_rank_group()
    fns = _methods(methods)
    gen = torch.Generator().manual_seed(0)
    shard = (2 * torch.randn(args.tokens, args.width, generator=gen)).to(DTYPES[args.dtype])
    target = torch.randint(0, args.width, (args.tokens,), generator=gen)
    times = {name: {"fwd": [], "bwd": []} for name in fns}
    losses = {}
    for _ in range(1 + args.rounds):  # the first round warms up (and builds the native kernels)
        for name, fn in fns.items():
            x = shard.clone().requires_grad_(True)
            c0 = time.process_time()
            loss = fn(x, target).float().mean()
            c1 = time.process_time()
            loss.backward()
            c2 = time.process_time()
            times[name]["fwd"].append((c1 - c0) * 1e3)
            times[name]["bwd"].append((c2 - c1) * 1e3)
            losses[name] = loss.item()
            del x, loss
    print(f"torch {torch.__version__}; one rank, [{args.tokens}, {args.width}] {args.dtype}, 1 thread; "
          f"CPU ms, min of {args.rounds} alternated rounds after 1 warm-up")  # fmt: skip
    rows = []
    ref = None
    for name in fns:
        fwd, bwd = min(times[name]["fwd"][1:]), min(times[name]["bwd"][1:])
        if ref is None and name == "megatron":
            ref = (bwd, fwd + bwd)
        row = {"name": name, "fwd_ms": fwd, "bwd_ms": bwd, "fwd_bwd_ms": fwd + bwd}
        if ref:  # ratios only against a Megatron row measured in the same rounds
            row.update(bwd_vs_megatron=bwd / ref[0], fwd_bwd_speedup=ref[1] / (fwd + bwd))
        row["loss"] = losses[name]
        rows.append(row)
    config = {
        "dtype": args.dtype, "tokens": args.tokens, "width": args.width, "rounds": args.rounds,
        "methods": list(fns), "threads": 1, "timer": "process CPU time, min over rounds",
        "load_average": load_average,
    }  # fmt: skip
    write_results("ce_backward_ab", config, rows, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
