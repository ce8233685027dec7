"""Is the CPU cross-entropy's cache-derived block size near the best on this machine? (issue 28 item 4)

The CPU loss kernels take their block sizes from the machine's caches (``shardkit.kernels.cpu_cache``),
never from a constant tuned on one CPU. This sweeps each size around the chosen one on one process,
one thread, and prints the CPU time of each, the chosen one marked, so that a CPU with another cache
hierarchy (e.g. an AMD EPYC) shows at once whether the choice is sound there:

- ``native statistics``: the forward's native kernel (fp32 and bf16) reads each row in chunks of
  ``columns`` (chosen: half the L1d); swept from 256 columns to the whole row.
- ``torch path``: the pure-torch blocks (fp16 logits, soft-capping, ``SHARDKIT_NATIVE=0``), forward +
  backward; the rows per block follow the L2 size (chosen: the working set within half the L2), swept
  by pretending the L2 is 256 KiB ... 32 MiB.
- ``native gradient``: the backward's native pass into a fresh buffer (its pages mapped by
  ``SHARDKIT_CE_PAGES`` "touch" or "populate") and into a buffer whose pages are already mapped; the
  backward has no cache-derived size (it computes through a fixed 4 KiB fp32 piece, within any L1d).

Usage (about 1 minute on an idle 2-core VM)::

    ./dev python benchmarks/ce_block_sweep.py [--tokens 1024 --width 64000 --repeats 3] [--out DIR]

Results: one table row per swept size (its sweep, CPU ms, ratio to the sweep's best, whether it is the
chosen size) and ``--out DIR/ce_block_sweep.json`` (``benchmarks/common.py``).
CPU time (``time.process_time``), min over ``--repeats`` alternated rounds: on a loaded machine the
wall time would count other processes' turns.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

# run as a script (the usage above), the checkout's root is not on the path: benchmarks.common needs it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_results  # noqa: E402
from shardkit.kernels import kernel_backend, native_ops  # noqa: E402
from shardkit.kernels.cpu_cache import CacheSizes, cache_sizes, columns_in_cache
from shardkit.kernels.cross_entropy import PAGE_MODES, gradient_page_mode
from shardkit.losses import statistics as st
from shardkit.losses import vocab_parallel_cross_entropy


def _cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


def _sweep(cases: dict, repeats: int) -> dict:
    """``{name: min CPU ms}``, the cases alternated round by round."""
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(_cpu_ms(fn))
    return {name: min(values) for name, values in times.items()}


def _rows(sweep: str, title: str, results: dict, chosen) -> List[dict]:
    """One table row per swept size: its CPU ms, the ratio to the sweep's best, the chosen one marked."""
    best = min(results.values())
    print(f"{sweep}: {title}")
    return [
        {"name": f"{sweep} {name}", "cpu_ms": ms, "vs_best": ms / best, "chosen": name == chosen}
        for name, ms in results.items()
    ]


def native_statistics(ops, tokens: int, width: int, repeats: int) -> List[dict]:
    rows = []
    l1d = cache_sizes().l1d
    for dtype in (torch.float32, torch.bfloat16):
        x = (2 * torch.randn(tokens, width)).to(dtype)
        index = torch.randint(0, width, (tokens,))
        owned = torch.ones(tokens, dtype=torch.bool)
        chosen = columns_in_cache(x.element_size(), l1d)
        chunks = sorted({256, 1024, 2048, 4096, 8192, 16384, chosen, width})
        cases = {
            c: (
                lambda c=c, x=x, index=index, owned=owned: ops.ce_statistics(
                    x, index, owned, width, 1.0, False, c
                )
            )
            for c in chunks
        }
        title = f"native statistics, {dtype}, [{tokens}, {width}]: columns per chunk"
        sweep = f"statistics {str(dtype).replace('torch.', '')}"
        rows += _rows(sweep, title, _sweep(cases, repeats), chosen)
    return rows


def torch_path(tokens: int, width: int, repeats: int) -> List[dict]:
    real = cache_sizes()
    x = (2 * torch.randn(tokens, width)).to(torch.float16)
    target = torch.randint(0, width, (tokens,))

    def step(l2: int):
        def run():
            st.cache_sizes = lambda: CacheSizes(real.l1d, l2, "sweep")
            try:
                leaf = x.clone().requires_grad_()
                with kernel_backend("torch"):
                    vocab_parallel_cross_entropy(leaf, target, reduction="mean").backward()
            finally:
                st.cache_sizes = cache_sizes

        return run

    sizes = sorted({256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 32 << 20, real.l2})
    chosen_rows = st.cache_rows(width, 4096, x.device, 2)
    names = {s: f"L2 {s >> 10} KiB" + (f" ({chosen_rows} rows)" if s == real.l2 else "") for s in sizes}
    results = _sweep({names[s]: step(s) for s in sizes}, repeats)
    title = f"torch path (fp16), fwd + bwd, [{tokens}, {width}]: rows per block from the L2 size"
    return _rows("torch path", title, results, names[real.l2])


def native_gradient(ops, tokens: int, width: int, repeats: int) -> List[dict]:
    x = 2 * torch.randn(tokens, width)
    lse = torch.logsumexp(x, 1).contiguous()
    coef = torch.full((tokens,), 1.0 / tokens)
    index = torch.randint(0, width, (tokens,))
    minus_target = -coef
    active = torch.ones(tokens, dtype=torch.bool)
    mapped = torch.zeros_like(x)
    chosen = gradient_page_mode(ops)

    def run(mode):
        def go():
            if mode == "mapped":
                ops.ce_gradient(x, mapped, lse, coef, minus_target, None, index, active, width, 1.0)
                return
            ops.ce_fault_mode(PAGE_MODES[mode])
            out = torch.empty_like(x)
            ops.ce_gradient(x, out, lse, coef, minus_target, None, index, active, width, 1.0)

        return go

    try:
        results = _sweep({m: run(m) for m in ("touch", "populate", "mapped")}, repeats)
    finally:
        ops.ce_fault_mode(PAGE_MODES[chosen])
    title = f"native gradient, fp32, [{tokens}, {width}]: fresh buffer by page mode, or already mapped"
    return _rows("gradient", title, results, chosen)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--width", type=int, default=64000, help="columns of one rank's shard (V / tp)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="directory for ce_block_sweep.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_average = list(os.getloadavg())
    sizes = cache_sizes()
    print(
        f"caches ({sizes.source}): L1d {sizes.l1d >> 10} KiB, L2 {sizes.l2 >> 10} KiB; torch",
        torch.__version__,
    )
    ops = native_ops()
    rows = []
    if ops is None:
        print("native kernels not built here: only the torch path runs")
    else:
        rows += native_statistics(ops, args.tokens, args.width, args.repeats)
        rows += native_gradient(ops, args.tokens, args.width, args.repeats)
    rows += torch_path(args.tokens, args.width, args.repeats)
    config = {
        "tokens": args.tokens, "width": args.width, "repeats": args.repeats, "threads": 1,
        "timer": "process CPU time, min over alternated rounds", "native": ops is not None,
        "cache_sizes": {"l1d": sizes.l1d, "l2": sizes.l2, "source": sizes.source},
        "load_average": load_average,
    }  # fmt: skip
    write_results("ce_block_sweep", config, rows, args.out)


if __name__ == "__main__":
    main()
