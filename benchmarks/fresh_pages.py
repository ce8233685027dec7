"""What a fresh large CPU buffer costs to write, and what huge pages save (``shardkit.huge_pages``).

``python -m benchmarks.fresh_pages [--mib 128] [--calls 7]``: one thread, thread CPU per call, median
of ``--calls``:

- ``write``: a copy of ``--mib`` MiB into a fresh ``torch.empty`` buffer (its pages faulted in and
  zeroed by the kernel on the first write), into a fresh one advised by ``huge_pages.advise``, and into
  a reused one (the floor);
- ``forward``: the native pooled forward (batch-major output, as the sharded lookups call it) at the
  shapes of three of the sweep's weak rows (``vs_torchrec_sweep`` rows 40, 41 and 45: their lookups'
  ids and output sizes, uniform ids), its output advised (the default) and not
  (``SHARDKIT_HUGE_PAGES=0``), each in a child process, alternated ``--rounds`` times.

Ratio columns: plain / advised (> 1: the advice saves time). Needs Linux with THP not ``never`` for a
difference; elsewhere both columns measure the same thing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

# (row, batch, features on the rank, dim, mean ids per bag, rows in the buffer)
SHAPES = [
    ("row40", 2048, 64, 64, 4, 131072),
    ("row41", 4096, 128, 64, 2, 500000),
    ("row45", 2048, 256, 128, 2, 65536),
]


def _median_cpu_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.thread_time()
        fn()
        times.append((time.thread_time() - start) * 1e3)
    times.sort()
    return times[len(times) // 2]


def write_costs(mib: int, calls: int) -> Dict[str, float]:
    """Thread-CPU ms of writing ``mib`` MiB into a fresh, a fresh advised and a reused buffer."""
    from shardkit import huge_pages

    n = mib << 18  # fp32 values
    src = torch.ones(n)
    reused = torch.zeros(n)

    def fresh() -> None:
        torch.empty(n).copy_(src)

    def advised() -> None:
        huge_pages.advise(torch.empty(n)).copy_(src)

    return {
        "fresh_ms": _median_cpu_ms(fresh, calls),
        "advised_ms": _median_cpu_ms(advised, calls),
        "reused_ms": _median_cpu_ms(lambda: reused.copy_(src), calls),
    }


def forward_costs(calls: int) -> Dict[str, float]:
    """Thread-CPU ms of the native forward at each of SHAPES (this process's huge-pages setting)."""
    from shardkit.kernels.embedding import embedding_forward, kernel_backend

    out = {}
    for name, batch, features, dim, pooling, rows in SHAPES:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(rows, dim, generator=gen)
        lengths = torch.randint(1, 2 * pooling, (features * batch,), generator=gen)
        per = rows // features
        ids = torch.randint(0, per, (int(lengths.sum()),), generator=gen)
        shift = (torch.arange(features) * per).repeat_interleave(batch)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        args = (weight, ids, offsets, shift)
        with kernel_backend("native"):
            out[name] = _median_cpu_ms(lambda a=args, b=batch: embedding_forward(*a, batch_major=b), calls)
    return out


def _child(calls: int, huge: bool) -> Dict[str, float]:
    env = dict(os.environ, SHARDKIT_HUGE_PAGES="1" if huge else "0")
    code = f"import json, benchmarks.fresh_pages as f; print(json.dumps(f.forward_costs({calls})))"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="buffer size of the write rows")
    parser.add_argument("--calls", type=int, default=7, help="calls per measurement (median)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the forward children")
    parser.add_argument("--out", help="JSON directory (default: a new one outside the checkout)")
    args = parser.parse_args(argv)
    from benchmarks.common import write_results
    from shardkit import huge_pages
    from shardkit.kernels import native_ops

    torch.set_num_threads(1)
    rows: List[Dict[str, Any]] = []
    w = write_costs(args.mib, args.calls)
    rows.append(
        {
            "name": f"write {args.mib} MiB",
            "plain_ms": round(w["fresh_ms"], 2),
            "advised_ms": round(w["advised_ms"], 2),
            "reused_ms": round(w["reused_ms"], 2),
            "ratio": round(w["fresh_ms"] / w["advised_ms"], 2),
        }
    )
    if native_ops() is not None:
        best: Dict[bool, Dict[str, float]] = {False: {}, True: {}}
        for _ in range(args.rounds):
            for huge in (False, True):
                for name, ms in _child(args.calls, huge).items():
                    best[huge][name] = min(best[huge].get(name, ms), ms)
        for name, *_ in SHAPES:
            plain, advised = best[False][name], best[True][name]
            rows.append(
                {
                    "name": f"forward {name}",
                    "plain_ms": round(plain, 2),
                    "advised_ms": round(advised, 2),
                    "reused_ms": None,
                    "ratio": round(plain / advised, 2),
                }
            )
    config = {"mib": args.mib, "calls": args.calls, "rounds": args.rounds, "advised": huge_pages.enabled()}
    write_results("fresh_pages", config, rows, args.out)


if __name__ == "__main__":
    main()
